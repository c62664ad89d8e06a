//! The kernel benchmarks: `shardnet bench gemm` (the f32 GEMMs of the
//! head and of the convolutions against the core's FMA peak: the `gemm`
//! crate, our `sgemm`, and bf16) and `shardnet bench conv` (every VGG16
//! convolution shape, forward and forward + backward, against the GEMM
//! bound).

use candle_core::{DType, Tensor};
use shardnet::Result;
use std::time::Instant;

/// The distinct convolution shapes of VGG16 on 32×32 inputs:
/// (in channels, out channels, side), all 3×3 with padding 1.
pub const VGG16_CONV_SHAPES: [(usize, usize, usize); 9] = [
    (3, 64, 32),
    (64, 64, 32),
    (64, 128, 16),
    (128, 128, 16),
    (128, 256, 8),
    (256, 256, 8),
    (256, 512, 4),
    (512, 512, 4),
    (512, 512, 2),
];

/// The median of a few timings of `f`, in seconds, after `warmup` calls.
fn median_seconds(reps: usize, warmup: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// The machine's f32 GEMM rate (FLOP/s) through the `gemm` crate on the
/// current thread count: a 1024³ product, median of 5.
pub fn gemm_rate() -> Result<f64> {
    let n = 1024;
    let a = vec![1f32; n * n];
    let b = vec![1f32; n * n];
    let mut c = vec![0f32; n * n];
    let s = median_seconds(5, 2, || {
        shardnet::kernels::matmul(n, n, n, &mut c, false, (&a, n, 1), (&b, n, 1));
        std::hint::black_box(&c);
        Ok(())
    })?;
    Ok(2.0 * (n * n * n) as f64 / s)
}

/// `shardnet bench conv`: forward and forward+backward (dx, dW, db) time of
/// every VGG16 convolution shape at batch `batch` with our kernels (Winograd's
/// path where it applies), the same layer on im2col GEMMs, and the bound of
/// im2col's multiplications at this machine's GEMM rate; a markdown table.
/// The backward runs from a fixed random output gradient g
/// ([`backward_from`](shardnet::functions::backward_from), PyTorch's
/// `y.backward(g)` in `bench/torch_conv_layers.py`).
pub fn conv(batch: usize, reps: usize) -> Result<()> {
    use shardnet::nn::{Conv2d, Param};
    let threads = shardnet::kernels::threads();
    let rate = gemm_rate()?;
    let (peak, isa) = shardnet::kernels::fma_peak();
    println!(
        "batch {batch}, {threads} thread(s); GEMM rate {:.1} GFLOP/s (1024³ f32, gemm crate); \
         one core's FMA peak {:.1} GFLOP/s ({isa})\n",
        rate / 1e9,
        peak / 1e9
    );
    println!("| in → out @ side | GFLOP fwd | ours fwd (ms) | ours fwd+bwd (ms) | GEMM bound fwd+bwd (ms) | ours / bound | im2col fwd (ms) | im2col fwd+bwd (ms) |");
    println!("|---|---|---|---|---|---|---|---|");
    let dev = &shardnet::comm::HOST;
    for (c, o, side) in VGG16_CONV_SHAPES {
        let x =
            candle_core::Var::from_tensor(&Tensor::randn(0f32, 1., (batch, c, side, side), dev)?)?;
        let w = Tensor::randn(0f32, 0.1, (o, c, 3, 3), dev)?;
        let b = Tensor::zeros(o, DType::F32, dev)?;
        let g = Tensor::randn(0f32, 1., (batch, o, side, side), dev)?;
        let conv = Conv2d::new(Param::new("w", &w)?, Some(Param::new("b", &b)?), 1, 1)?;
        let ours_fwd = median_seconds(reps, 2, || {
            std::hint::black_box(conv.forward(x.as_tensor())?);
            Ok(())
        })?;
        let ours = median_seconds(reps, 2, || {
            let y = conv.forward(x.as_tensor())?;
            std::hint::black_box(shardnet::functions::backward_from(&y, &g)?);
            Ok(())
        })?;
        // The same layer with Winograd's path off (im2col GEMMs).
        shardnet::nn::set_winograd(false);
        shardnet::nn::set_dense(false);
        let im2col_fwd = median_seconds(reps, 2, || {
            std::hint::black_box(conv.forward(x.as_tensor())?);
            Ok(())
        });
        let im2col = median_seconds(reps, 2, || {
            let y = conv.forward(x.as_tensor())?;
            std::hint::black_box(shardnet::functions::backward_from(&y, &g)?);
            Ok(())
        });
        shardnet::nn::set_winograd(true);
        shardnet::nn::set_dense(true);
        let (im2col_fwd, im2col) = (im2col_fwd?, im2col?);
        let flop = 2.0 * (batch * o * c * 9 * side * side) as f64;
        let bound = 3.0 * flop / rate;
        println!(
            "| {c} → {o} @ {side} | {:.2} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} |",
            flop / 1e9,
            ours_fwd * 1e3,
            ours * 1e3,
            bound * 1e3,
            ours / bound,
            im2col_fwd * 1e3,
            im2col * 1e3
        );
    }
    Ok(())
}

/// `shardnet bench gemm`: one thread's GEMM rate (GFLOP/s) next to the
/// core's f32 FMA peak ([`shardnet::kernels::fma_peak`]), in f32 (the
/// `gemm` crate, what `Linear`, the head and im2col convolutions call; and
/// `kernels::sgemm`, ours, A packed in every call but Winograd's rows,
/// which pack it once as the convolution packs U once a step; Winograd's
/// and the small images' convolutions call it) and with bf16 inputs
/// (the `kernels::bf16` GEMM, where the CPU has AVX-512 BF16), at the
/// sharded head's three shapes for one class block (B = 256, d = 512,
/// `CLASS_BLOCK` classes; the operands laid out as the head lays them out)
/// at a VGG16 convolution's forward GEMM (`conv`: 256 → 256 at 8 × 8,
/// batch 32, im2col layout), at 1024³ and at one tile position's GEMM of a
/// Winograd chunk for each of VGG16's four widths at batch 32 (`wino64`,
/// `wino128`, `wino256`, `wino512`; for these also our sgemm with the
/// packed U read across as Uᵀ, as the input gradient runs it, and the
/// weight gradient's dU = dM · Vᵀ with dM read where it lies). Prints a
/// markdown table, or with `json` one JSON object: `{"fma_peak_gflops":
/// x, "fma_isa": "avx2", "f32_gflops": {...}, "sgemm_gflops": {...}
/// (empty without AVX2 + FMA), "sgemm_across_gflops": {...} (the `wino`
/// keys only), "sgemm_dw_gflops": {...} (the `wino` keys only),
/// "bf16_gflops": {...} | null, "avx512_bf16": bool, "bf16_kernel": "amx"
/// | "avx512_bf16" | null}` with keys `logits`, `dx`, `dw`, `conv`,
/// `square`, `wino64`, `wino128`, `wino256`, `wino512`.
pub fn gemm(json: bool, reps: usize) -> Result<()> {
    use shardnet::kernels::bf16::{has_avx512_bf16, matmul_bf16};
    use shardnet::kernels::matmul_strided;
    let (b, d, c) = (256, 512, shardnet::functions::CLASS_BLOCK);
    let x = vec![0.5f32; b * d];
    let w = vec![0.25f32; c * d];
    let g = vec![0.125f32; b * c];
    let sq = vec![1f32; 1024 * 1024];
    let cw = vec![0.5f32; 256 * 2304];
    let col = vec![0.5f32; 2304 * 2048];
    // Winograd's chunk buffers start a cache line (`kernels::sized_aligned`),
    // as do C's here.
    let mut wino_buf = Vec::new();
    let wino = shardnet::kernels::sized_aligned(&mut wino_buf, 512 * 512);
    wino.fill(0.5);
    let wino = &*wino;
    let mut out_buf = Vec::new();
    let out = shardnet::kernels::sized_aligned(&mut out_buf, (b * c).max(c * d).max(1024 * 1024));
    // (name, m, n, k, a, b): the head's operand layouts.
    type Shape<'a> = (
        &'static str,
        usize,
        usize,
        usize,
        (&'a [f32], usize, usize),
        (&'a [f32], usize, usize),
    );
    let shapes: [Shape; 9] = [
        ("logits", b, c, d, (&x, d, 1), (&w, 1, d)),
        ("dx", b, d, c, (&g, c, 1), (&w, d, 1)),
        ("dw", c, d, b, (&g, 1, c), (&x, d, 1)),
        ("conv", 256, 2048, 2304, (&cw, 2304, 1), (&col, 2048, 1)),
        ("square", 1024, 1024, 1024, (&sq, 1024, 1), (&sq, 1024, 1)),
        // One tile position's GEMM of a Winograd chunk at batch 32, M = U·V
        // (O × C times C × the chunk's tiles), as `nn::conv::winograd` calls
        // it: 64 → 64 @ 32 (one image, 256 tiles), 128 → 128 @ 16 (one image),
        // 256 → 256 @ 8 (8 images), 512 → 512 @ 4 (16 images).
        ("wino64", 64, 256, 64, (wino, 64, 1), (wino, 256, 1)),
        ("wino128", 128, 64, 128, (wino, 128, 1), (wino, 64, 1)),
        ("wino256", 256, 128, 256, (wino, 256, 1), (wino, 128, 1)),
        ("wino512", 512, 64, 512, (wino, 512, 1), (wino, 64, 1)),
    ];
    let (peak, fma_isa) = shardnet::kernels::fma_peak();
    let bf16 = has_avx512_bf16();
    let bf16_kernel = match (bf16, shardnet::kernels::has_amx_bf16()) {
        (false, _) => None,
        (true, true) => Some("amx"),
        (true, false) => Some("avx512_bf16"),
    };
    let mut rows = Vec::new();
    for (name, m, n, k, a, bb) in shapes {
        let flops = 2.0 * (m * n * k) as f64;
        // Winograd's U is packed once a step, outside its GEMMs; every other
        // call packs A, as the im2col convolutions' calls do.
        let packed_once = match shardnet::kernels::sgemm::Micro::now() {
            Some(micro) if name.starts_with("wino") => Some(
                shardnet::kernels::sgemm::PackedA::new(
                    micro,
                    m,
                    k,
                    a.0,
                    shardnet::kernels::sgemm::Layout::strided(a.1, a.2),
                )
                .with_across_slack(),
            ),
            _ => None,
        };
        let f32_s = median_seconds(reps, 2, || {
            matmul_strided(m, n, k, (&mut out[..m * n], n, 1), false, a, bb);
            std::hint::black_box(&out);
            Ok(())
        })?;
        let ours_s = match shardnet::kernels::sgemm::Micro::now() {
            Some(micro) => Some(median_seconds(reps, 2, || {
                use shardnet::kernels::sgemm::{gemm, Layout, Matrix, Out, PackedA};
                let fresh;
                let pa = match &packed_once {
                    Some(u) => u,
                    None => {
                        fresh = PackedA::new(micro, m, k, a.0, Layout::strided(a.1, a.2));
                        &fresh
                    }
                };
                let mb = Matrix {
                    b: bb.0,
                    k,
                    n,
                    layout: Layout::strided(bb.1, bb.2),
                };
                shardnet::kernels::serial(|| gemm(pa, &mb, Out::rows(&mut out[..m * n], n), false));
                std::hint::black_box(&out);
                Ok(())
            })?),
            None => None,
        };
        // The input gradient's GEMM at the same layer: U (O × C) read across
        // as Uᵀ, times dM (O × the chunk's tiles): C × tiles × O, which is
        // m × n × k again where O = C (all four rows).
        let across_s = match &packed_once {
            Some(u) if m == k => Some(median_seconds(reps, 2, || {
                use shardnet::kernels::sgemm::{gemm_transposed, Layout, Matrix, Out};
                let mb = Matrix {
                    b: bb.0,
                    k: m,
                    n,
                    layout: Layout::strided(bb.1, bb.2),
                };
                let c = Out::rows(&mut out[..k * n], n);
                shardnet::kernels::serial(|| gemm_transposed(u, &mb, c, false));
                std::hint::black_box(&out);
                Ok(())
            })?),
            _ => None,
        };
        // The weight gradient's GEMM at the same layer: dU (O × C) = dM (O ×
        // the chunk's tiles, read where it lies) · Vᵀ (V: C × the tiles),
        // O × C × tiles, which is m × k × n (the same flops).
        let rows_s = match (&packed_once, shardnet::kernels::sgemm::Micro::now()) {
            (Some(_), Some(micro)) => Some(median_seconds(reps, 2, || {
                use shardnet::kernels::sgemm::{gemm_rows, Layout, Matrix, Out, Rows};
                let dm = Rows {
                    a: &wino[..m * n],
                    m,
                    k: n,
                    lda: n,
                };
                let vt = Matrix {
                    b: &wino[..k * n],
                    k: n,
                    n: k,
                    layout: Layout::strided(1, n),
                };
                let c = Out::rows(&mut out[..m * k], k);
                shardnet::kernels::serial(|| gemm_rows(micro, dm, &vt, c, false));
                std::hint::black_box(&out);
                Ok(())
            })?),
            _ => None,
        };
        let bf16_s = if bf16 {
            Some(median_seconds(reps, 2, || {
                matmul_bf16(m, n, k, (&mut out[..m * n], n, 1), false, a, bb);
                std::hint::black_box(&out);
                Ok(())
            })?)
        } else {
            None
        };
        rows.push((
            name,
            m,
            n,
            k,
            flops / f32_s / 1e9,
            ours_s.map(|s| flops / s / 1e9),
            across_s.map(|s| flops / s / 1e9),
            rows_s.map(|s| flops / s / 1e9),
            bf16_s.map(|s| flops / s / 1e9),
        ));
    }
    if json {
        let (mut f, mut h) = (serde_json::Map::new(), serde_json::Map::new());
        let (mut o, mut t) = (serde_json::Map::new(), serde_json::Map::new());
        let mut r = serde_json::Map::new();
        for (name, _, _, _, f32_rate, ours_rate, across_rate, rows_rate, bf16_rate) in &rows {
            f.insert(name.to_string(), serde_json::json!(f32_rate));
            if let Some(r) = ours_rate {
                o.insert(name.to_string(), serde_json::json!(r));
            }
            if let Some(x) = across_rate {
                t.insert(name.to_string(), serde_json::json!(x));
            }
            if let Some(x) = rows_rate {
                r.insert(name.to_string(), serde_json::json!(x));
            }
            if let Some(r) = bf16_rate {
                h.insert(name.to_string(), serde_json::json!(r));
            }
        }
        let h = if bf16 {
            serde_json::Value::Object(h)
        } else {
            serde_json::Value::Null
        };
        let v = serde_json::json!({
            "fma_peak_gflops": peak / 1e9, "fma_isa": fma_isa,
            "f32_gflops": f, "sgemm_gflops": o, "sgemm_across_gflops": t,
            "sgemm_dw_gflops": r,
            "bf16_gflops": h, "avx512_bf16": bf16,
            "bf16_kernel": bf16_kernel
        });
        println!("{v}");
        return Ok(());
    }
    println!(
        "f32 FMA peak of one core: {:.1} GFLOP/s ({fma_isa}); bf16 kernel: {}\n",
        peak / 1e9,
        match bf16_kernel {
            Some("amx") => "AMX tiles",
            Some(_) => "AVX-512 BF16",
            None => "none (the f32 fallback)",
        }
    );
    println!(
        "| GEMM | m × n × k | f32 GFLOP/s | % of FMA peak | our sgemm GFLOP/s | % of FMA peak | \
         ours, A read across (Uᵀ) | % of FMA peak | ours, dU = dM·Vᵀ | % of FMA peak | \
         bf16 GFLOP/s | bf16 / f32 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let pct = |rate: f64| {
        if peak > 0.0 {
            format!("{:.0}%", 100.0 * rate * 1e9 / peak)
        } else {
            "n/a".into()
        }
    };
    for (name, m, n, k, f, o, t, r, h) in rows {
        let (os, opct) = o.map_or(("n/a".to_string(), String::new()), |o| {
            (format!("{o:.1}"), pct(o))
        });
        let (ts, tpct) = t.map_or((String::new(), String::new()), |t| {
            (format!("{t:.1}"), pct(t))
        });
        let (rs, rpct) = r.map_or((String::new(), String::new()), |r| {
            (format!("{r:.1}"), pct(r))
        });
        let (hs, ratio) = match h {
            Some(h) => (format!("{h:.1}"), format!("{:.2}", h / f)),
            None => ("n/a (no AVX-512 BF16)".into(), String::new()),
        };
        let fpct = pct(f);
        println!(
            "| {name} | {m} × {n} × {k} | {f:.1} | {fpct} | {os} | {opct} | {ts} | {tpct} | {rs} | {rpct} | {hs} | {ratio} |"
        );
    }
    Ok(())
}
