//! The fused passes against the layers they replace, bit for bit, and
//! against themselves at every vector width and thread count.

use super::*;
use crate::comm::{Communicator, HOST};
use crate::kernels::batch_norm::plane;

/// Every plane pass gives the same bits at every vector width: odd
/// lengths (tails), values with NaN, and the ReLU mask both ways.
#[test]
fn plane_passes_are_the_same_at_every_simd_level() {
    for n in [1usize, 7, 8, 9, 31, 64, 1000] {
        let mut x = crate::kernels::test_values(11, n);
        if n > 3 {
            x[3] = f32::NAN;
        }
        let g = crate::kernels::test_values(12, n);
        // m not a short binary fraction: the products round (an FMA would differ).
        let (m, mask) = (0.1f64, Some((1.5f32, -0.25f32)));
        let level = |what: &str, f: &dyn Fn() -> Vec<f64>| {
            crate::kernels::assert_same_at_every_level(what, f, |r| {
                r.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            })
        };
        level("sum", &|| vec![plane::sum(&g)]);
        level("centred squares", &|| vec![plane::centred_squares(&g, m)]);
        level("grad sums, masked", &|| {
            plane::grad_sums(&g, &x, m, mask).to_vec()
        });
        level("grad sums", &|| plane::grad_sums(&g, &x, m, None).to_vec());
        for relu in [false, true] {
            level("affine", &|| {
                let mut o = vec![0f32; n];
                plane::affine(&mut o, &x, (1.5, -0.25), relu);
                o.iter().map(|v| *v as f64).collect()
            });
        }
        for mask in [None, mask] {
            level("input grad", &|| {
                let mut o = vec![0f32; n];
                plane::input_grad(&mut o, &g, &x, ((0.5, 0.25, 0.75), m), mask);
                o.iter().map(|v| *v as f64).collect()
            });
        }
    }
}
use crate::nn::{max_pool2d, relu};
use candle_core::Var;

/// How the layer runs: alone, or across the ranks of `group`; batch
/// norm then ReLU as two layers or as `forward_relu`; the pooling after
/// as its own layer or in `forward_relu_pool` (with `fused_relu`).
#[derive(Clone, Copy)]
struct How<'a> {
    group: Option<&'a Communicator>,
    fused_relu: bool,
    fused_pool: bool,
}

/// y and every gradient of batch norm → ReLU → max pooling on `x`
/// (the window k from the sizes of x and g).
fn run(x: &Tensor, g: &Tensor, how: How) -> Result<Vec<Vec<f32>>> {
    let k = x.dims()[2] / g.dims()[2];
    let store = ParamStore::new(&HOST, 7);
    let mut bn = BatchNorm2d::new(&store, "bn", x.dims()[1])?;
    if let Some(c) = how.group {
        bn = bn.multi_node(Context::new(c));
    }
    let xv = Var::from_tensor(x)?;
    let y = if how.fused_pool {
        bn.forward_relu_pool(xv.as_tensor(), true, k)?
    } else if how.fused_relu {
        max_pool2d(&bn.forward_relu(xv.as_tensor(), true)?, k)?
    } else {
        max_pool2d(&relu(&bn.forward(xv.as_tensor(), true)?)?, k)?
    };
    let grads = y.mul(g)?.sum_all()?.backward()?;
    let dx = grads.get(xv.as_tensor()).cloned();
    let flat = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1::<f32>()?) };
    let missing = || Error::Usage("no gradient".into());
    Ok(vec![
        flat(&y)?,
        flat(&dx.ok_or_else(missing)?)?,
        flat(bn.weight.grad().ok_or_else(missing)?)?,
        flat(bn.bias.grad().ok_or_else(missing)?)?,
    ])
}

fn same(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    for (name, (p, q)) in ["y", "dx", "dγ", "dβ"].iter().zip(a.iter().zip(b)) {
        assert!(
            p.len() == q.len() && p.iter().zip(q).all(|(u, v)| u.to_bits() == v.to_bits()),
            "{name} differs: {what}"
        );
    }
}

fn inputs() -> Result<(Tensor, Tensor)> {
    // Large enough to split over threads (kernels::split_work), odd
    // sizes, about half the values below zero after normalisation.
    Ok((
        Tensor::randn(0.5f32, 2.0, (5, 24, 18, 18), &HOST)?,
        Tensor::randn(0f32, 1.0, (5, 24, 9, 9), &HOST)?,
    ))
}

#[test]
fn passes_split_over_threads_equal_one_thread_bit_for_bit() -> Result<()> {
    if !crate::kernels::fast(&HOST) {
        return Ok(());
    }
    let (x, g) = inputs()?;
    if crate::kernels::threads() < 2 {
        println!("one thread here: the split passes are not exercised");
    }
    for (fused_relu, fused_pool) in [(false, false), (true, false), (true, true)] {
        let how = How {
            group: None,
            fused_relu,
            fused_pool,
        };
        let split = run(&x, &g, how)?;
        let one = crate::kernels::serial(|| run(&x, &g, how))?;
        same(
            &split,
            &one,
            &format!("split vs one thread, fused ReLU {fused_relu}"),
        );
    }
    Ok(())
}

/// (fused, two layers) on x, alone or across `group`.
type Pair = (Vec<Vec<f32>>, Vec<Vec<f32>>);
fn fused_and_two(x: &Tensor, g: &Tensor, group: Option<&Communicator>) -> Result<Pair> {
    let how = |fused_relu| How {
        group,
        fused_relu,
        fused_pool: false,
    };
    Ok((run(x, g, how(true))?, run(x, g, how(false))?))
}

/// Batch norm, ReLU and the pooling as one op against the three layers,
/// bit for bit: y, dx, dγ, dβ; windows of 2 and 3, sizes they divide
/// and sizes they do not (the last rows and columns dropped), one rank
/// and two thread ranks with their own images (the group's path).
#[test]
fn pooling_fused_into_batch_norm_equals_the_three_layers_bit_for_bit() -> Result<()> {
    for (h, w, k) in [(18, 18, 2), (19, 17, 2), (19, 17, 3), (4, 4, 4)] {
        let x = Tensor::randn(0.5f32, 2.0, (5, 24, h, w), &HOST)?;
        let g = Tensor::randn(0f32, 1.0, (5, 24, h / k, w / k), &HOST)?;
        fn pair(x: &Tensor, g: &Tensor, group: Option<&Communicator>) -> Result<Pair> {
            // One op, or batch norm, ReLU and pooling as three layers.
            let how = |fused_pool: bool| How {
                group,
                fused_relu: false,
                fused_pool,
            };
            Ok((run(x, g, how(true))?, run(x, g, how(false))?))
        }
        alone_and_on_two_ranks(&x, &g, pair, &format!("{h}×{w}, k {k}"))?;
    }
    Ok(())
}

/// The two runs of `pair` compared on one rank, then on each of 2 thread
/// ranks with their own images (3 and 2).
fn alone_and_on_two_ranks(
    x: &Tensor,
    g: &Tensor,
    pair: fn(&Tensor, &Tensor, Option<&Communicator>) -> Result<Pair>,
    what: &str,
) -> Result<()> {
    let (one, other) = pair(x, g, None)?;
    same(&one, &other, &format!("one rank, {what}"));
    let rows = [0..3, 3..5];
    let per_rank = crate::comm::run("local", 2, |c| {
        let r = rows[c.rank()].clone();
        let mine = |t: &Tensor| t.narrow(0, r.start, r.len());
        pair(&mine(x)?, &mine(g)?, Some(&c))
    })?;
    for (r, (one, other)) in per_rank.iter().enumerate() {
        same(one, other, &format!("rank {r} of 2, {what}"));
    }
    Ok(())
}

#[test]
fn relu_fused_into_batch_norm_equals_the_two_layers_bit_for_bit() -> Result<()> {
    let (x, g) = inputs()?;
    alone_and_on_two_ranks(&x, &g, fused_and_two, "ReLU fused")
}

/// The group's statistics merged from every rank's (count, Σx, Σ(x − x̄)²)
/// equal two passes over the whole batch in f64: random splits into 1–4
/// parts (some empty), values whose mean is 10⁶ times their spread (where
/// Σx² − Nμ² would lose about 4 of f64's 16 digits).
#[test]
fn merged_statistics_equal_two_passes_over_the_whole_batch() {
    use super::op::{merge, Part};
    let mut state = 11u64;
    // Uniform in 0..k, and in [−1, 1).
    let mut below = |k: usize| ((crate::rng::unit(&mut state) + 1.0) / 2.0 * k as f64) as usize;
    let mut uniform = {
        let mut state = 12u64;
        move || crate::rng::unit(&mut state)
    };
    for case in 0..200 {
        let len = below(40) + 1;
        let (offset, spread) = if case % 2 == 0 {
            (1e4, 1e-2)
        } else {
            (0.0, 1.0)
        };
        let x: Vec<f64> = (0..len).map(|_| offset + spread * uniform()).collect();
        let parts = below(4) + 1;
        // Cut points anywhere, repeats allowed (empty parts).
        let mut cuts: Vec<usize> = (0..parts - 1).map(|_| below(len + 1)).collect();
        cuts.sort_unstable();
        let bounds: Vec<usize> = std::iter::once(0)
            .chain(cuts)
            .chain(std::iter::once(len))
            .collect();
        let of = |s: &[f64]| {
            let n = s.len() as f64;
            let sum: f64 = s.iter().sum();
            let own = if s.is_empty() { 0.0 } else { sum / n };
            Part {
                n,
                sum,
                m2: s.iter().map(|v| (v - own) * (v - own)).sum(),
            }
        };
        let ps: Vec<Part> = bounds.windows(2).map(|w| of(&x[w[0]..w[1]])).collect();
        let (n, mean, m2) = merge(ps.iter().copied());
        let whole = of(&x);
        let want_mean = whole.sum / whole.n;
        assert_eq!(n, len as f64, "case {case}: count");
        assert!(
            // Sums of up to 40 terms in another order: within 40 ε.
            (mean - want_mean).abs() <= 64.0 * f64::EPSILON * want_mean.abs().max(1.0),
            "case {case}: mean {mean} against {want_mean}"
        );
        assert!(
            // Each part's x̄ᵢ − μ is off by a few ε·|μ| (10⁻¹² where it is
            // about 10⁻³); Σx² − Nμ² is off by parts in 10³.
            (m2 - whole.m2).abs() <= 1e-8 * whole.m2,
            "case {case}: Σ(x − μ)² {m2} against {} over parts {bounds:?}",
            whole.m2
        );
    }
    assert_eq!(merge(std::iter::empty()), (0.0, 0.0, 0.0));
}

/// Ranks whose layers have different channels are refused on every rank,
/// naming the peer, where the allgather itself would take any lengths.
#[test]
fn ranks_with_other_channels_are_refused_on_every_rank() -> Result<()> {
    if !crate::kernels::fast(&HOST) {
        return Ok(());
    }
    let errors = crate::comm::run("local", 2, |c| {
        let channels = 3 + c.rank();
        let store = ParamStore::new(&HOST, 7);
        let bn = BatchNorm2d::new(&store, "bn", channels)?.multi_node(Context::new(&c));
        let x = Tensor::randn(0f32, 1.0, (2, channels, 4, 4), &HOST)?;
        Ok(bn.forward(&x, true).err().map(|e| e.to_string()))
    })?;
    for (r, e) in errors.iter().enumerate() {
        let e = e.as_deref().unwrap_or("no error");
        assert!(
            e.contains("layers differ") && e.contains(&format!("rank {} of the group", 1 - r)),
            "rank {r}: {e}"
        );
    }
    Ok(())
}
