//! Winograd's passes against im2col's in f64.

use super::super::passes;
use super::*;
use crate::kernels::{level_lock, set_simd_level, test_values, SimdLevel};

/// A seeded stream of 3 × 3, stride-1 geometries: paddings 0–2, sides
/// 1–37 (tiles cut at odd sizes, rows of tiles past one lane block),
/// batches 1–4, 16–40 input and 1–70 output channels.
fn geometries(count: usize) -> Vec<Geom> {
    let mut next = passes::seeded_ints(0x3a3);
    let mut out = Vec::new();
    while out.len() < count {
        let p = next(0, 2);
        let (h, w) = (next(1, 37), next(1, 37));
        if h + 2 * p < 3 || w + 2 * p < 3 {
            continue;
        }
        let (n, c, o) = (next(1, 4), next(MIN_CHANNELS, 40), next(1, 70));
        out.push(geom(n, c, h, w, o, p));
    }
    out
}

fn geom(n: usize, c: usize, h: usize, w: usize, o: usize, p: usize) -> Geom {
    Geom {
        n,
        c,
        h,
        w,
        o,
        kh: 3,
        kw: 3,
        s: 1,
        p,
        ho: h + 2 * p - 2,
        wo: w + 2 * p - 2,
    }
}

fn wide(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn abs(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| (x as f64).abs()).collect()
}

/// Each entry within `tol` of the f64 value, relative to the sum of
/// its terms' magnitudes.
fn close(what: &str, g: &Geom, got: &[f32], want: &[f64], scale: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what} {g:?}: length");
    for (i, ((x, y), s)) in got.iter().zip(want).zip(scale).enumerate() {
        assert!(
            (*x as f64 - y).abs() <= tol * s + 1e-30,
            "{what} {g:?}: [{i}] = {x}, want {y} (Σ|terms| {s})"
        );
    }
}

fn levels() -> Vec<SimdLevel> {
    [SimdLevel::Avx512, SimdLevel::Avx2]
        .into_iter()
        .filter(|&l| {
            set_simd_level(l);
            Micro::now().is_some() && crate::kernels::simd_level() == l
        })
        .collect()
}

/// y, dx and dW against im2col's passes in f64, on every microkernel
/// and transform width this CPU has: within 1e-5 of Σ|terms| (the
/// bound the im2col tests use), y and dx the same bits at every level.
#[test]
fn equals_the_f64_convolution_on_every_level() {
    let _one = level_lock();
    let levels = levels();
    let mut cases = geometries(40);
    // VGG16's 64 → 64 at 32 × 32 (rows of 16 tiles, one lane block),
    // and deep, small images (a chunk of many images).
    cases.push(geom(2, 64, 32, 32, 64, 1));
    cases.push(geom(9, 64, 2, 2, 33, 1));
    // Over 256 channels each way: U in two blocks of C (the input
    // gradient's tiles cut at a block's end) and the input gradient's k
    // (O) in two blocks, the second starting inside a strip of U.
    cases.push(geom(2, 260, 4, 6, 262, 1));
    for g in cases {
        let x = test_values(1, g.n * g.c * g.h * g.w);
        let w = test_values(2, g.o * g.c * 9);
        let bias = test_values(3, g.o);
        let dy = test_values(4, g.n * g.o * g.ho * g.wo);
        let y64 = passes::forward(&g, &wide(&x), &wide(&w), &wide(&bias));
        let ys = passes::forward(&g, &abs(&x), &abs(&w), &abs(&bias));
        let dx64 = passes::input_grad(&g, &wide(&dy), &wide(&w));
        let dxs = passes::input_grad(&g, &abs(&dy), &abs(&w));
        let mut dw64 = vec![0f64; w.len()];
        passes::weight_grad(&g, &mut dw64, &wide(&dy), &wide(&x), true);
        let mut dws = vec![0f64; w.len()];
        passes::weight_grad(&g, &mut dws, &abs(&dy), &abs(&x), true);
        let mut first: Option<(Vec<f32>, Vec<f32>)> = None;
        for &level in &levels {
            set_simd_level(level);
            let y = forward(&g, &x, &pack(&g, &w), &bias);
            close("y", &g, &y, &y64, &ys, 1e-5);
            let dx = input_grad(&g, &dy, &w);
            close("dx", &g, &dx, &dx64, &dxs, 1e-5);
            // Accumulating onto what is there.
            let mut dw = vec![1f32; w.len()];
            weight_grad(&g, &mut dw, &dy, &x, false);
            let one: Vec<f64> = dw64.iter().map(|v| v + 1.0).collect();
            let one_s: Vec<f64> = dws.iter().map(|v| v + 1.0).collect();
            close("dW", &g, &dw, &one, &one_s, 1e-5);
            weight_grad(&g, &mut dw, &dy, &x, true);
            close("dW", &g, &dw, &dw64, &dws, 1e-5);
            match &first {
                None => first = Some((y, dx)),
                Some((y0, dx0)) => {
                    let same = |a: &[f32], b: &[f32]| {
                        a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
                    };
                    assert!(same(y0, &y) && same(dx0, &dx), "{g:?}: {level:?} differs");
                }
            }
        }
    }
    set_simd_level(SimdLevel::Avx512);
}

/// dx and dW in one pass: the same bits as the input gradient and the
/// weight gradient apart, accumulating and overwriting, on every level.
#[test]
fn one_pass_backward_equals_the_passes_apart() {
    let _one = level_lock();
    let levels = levels();
    let mut cases = geometries(16);
    // Many images a chunk, and chunks split over the threads.
    cases.push(geom(9, 64, 2, 2, 33, 1));
    cases.push(geom(6, 32, 16, 16, 24, 1));
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
    for g in cases {
        let x = test_values(1, g.n * g.c * g.h * g.w);
        let w = test_values(2, g.o * g.c * 9);
        let dy = test_values(4, g.n * g.o * g.ho * g.wo);
        for &level in &levels {
            set_simd_level(level);
            let want_dx = input_grad(&g, &dy, &w);
            for overwrite in [false, true] {
                let mut want_dw = test_values(5, w.len());
                weight_grad(&g, &mut want_dw, &dy, &x, overwrite);
                let mut dw = test_values(5, w.len());
                let dx = backward(&g, &dy, &x, Some(&pack(&g, &w)), &mut dw, overwrite)
                    .expect("dx with W");
                assert_eq!(dx.len(), want_dx.len(), "{g:?}");
                assert!(same(&dx, &want_dx), "{g:?} {level:?}: dx differs");
                assert!(same(&dw, &want_dw), "{g:?} {level:?}: dW differs");
            }
        }
    }
    set_simd_level(SimdLevel::Avx512);
}

/// The path takes 3 × 3 stride-1 kernels over enough channels and tiles,
/// and nothing else.
#[test]
fn applies_where_it_pays() {
    let _one = level_lock();
    set_simd_level(SimdLevel::Avx512);
    if Micro::now().is_none() {
        return;
    }
    // VGG16 at batch 32: 16 × 16 tiles per image; 4 × 4 images hold 4,
    // 2 × 2 images one.
    assert!(applies(&geom(32, 64, 32, 32, 64, 1)));
    assert!(applies(&geom(16, 512, 4, 4, 512, 1)));
    assert!(!applies(&geom(15, 512, 4, 4, 512, 1)));
    assert!(!applies(&geom(32, 512, 2, 2, 512, 1)));
    assert!(!applies(&geom(32, MIN_CHANNELS - 1, 32, 32, 64, 1)));
    let strided = Geom {
        s: 2,
        ho: 16,
        wo: 16,
        ..geom(32, 64, 32, 32, 64, 1)
    };
    assert!(!applies(&strided));
    let five = Geom {
        kh: 5,
        kw: 5,
        ho: 30,
        wo: 30,
        ..geom(32, 64, 32, 32, 64, 1)
    };
    assert!(!applies(&five));
    // (`set_enabled(false)` is not tried here: it is process-wide, and the
    // other tests' convolutions run meanwhile.)
}

/// The forward in bands of tile rows: the same bits as whole images, at
/// every band height, one image a chunk and several, on every level; and
/// VGG16's 64 → 64 @ 32 does run in bands.
#[test]
fn forward_in_bands_equals_whole_images() {
    let _one = level_lock();
    let levels = levels();
    let mut cases = geometries(10);
    // VGG16's 64 → 64 @ 32; odd sides (a last tile row of one output
    // row), no padding.
    cases.push(geom(2, 64, 32, 32, 64, 1));
    cases.push(geom(3, 16, 13, 9, 5, 0));
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
    for g in cases {
        let t = Tiles::of(&g);
        let x = test_values(1, g.n * g.c * g.h * g.w);
        let w = test_values(2, g.o * g.c * 9);
        let bias = test_values(3, g.o);
        for &level in &levels {
            set_simd_level(level);
            let u = pack(&g, &w);
            for q in [1, g.n.min(2)] {
                let whole = forward_in_bands(&g, &x, &u, &bias, (q, false), t.th);
                for band in 1..t.th {
                    let y = forward_in_bands(&g, &x, &u, &bias, (q, false), band);
                    assert!(
                        same(&y, &whole),
                        "{g:?} {level:?}: {q} images, bands of {band}"
                    );
                }
            }
        }
    }
    set_simd_level(SimdLevel::Avx512);
    let g = geom(32, 64, 32, 32, 64, 1);
    let t = Tiles::of(&g);
    assert!(band_rows(&g, &t, plan(&g, &t).0) < t.th);
    // Not where U alone fills L2.
    let g = geom(8, 128, 56, 56, 128, 1);
    let t = Tiles::of(&g);
    assert_eq!(band_rows(&g, &t, plan(&g, &t).0), t.th);
}

/// The backward in bands of tile rows: dx and dW within the f64 bound at
/// every band height, on every level. (dx is not the same bits as whole
/// images': where a row of tiles is cut between two blocks of 16, its
/// tiles' overlapping columns are added in another order.)
#[test]
fn backward_in_bands_equals_whole_images() {
    let _one = level_lock();
    let levels = levels();
    let mut cases = geometries(8);
    cases.push(geom(2, 64, 32, 32, 64, 1));
    cases.push(geom(3, 16, 13, 9, 5, 0));
    for g in cases {
        let t = Tiles::of(&g);
        let x = test_values(1, g.n * g.c * g.h * g.w);
        let w = test_values(2, g.o * g.c * 9);
        let dy = test_values(4, g.n * g.o * g.ho * g.wo);
        let mut dw64 = vec![0f64; w.len()];
        passes::weight_grad(&g, &mut dw64, &wide(&dy), &wide(&x), true);
        let mut dws = vec![0f64; w.len()];
        passes::weight_grad(&g, &mut dws, &abs(&dy), &abs(&x), true);
        let dx64 = passes::input_grad(&g, &wide(&dy), &wide(&w));
        let dxs = passes::input_grad(&g, &abs(&dy), &abs(&w));
        for &level in &levels {
            set_simd_level(level);
            let u = pack(&g, &w);
            for band in 1..=t.th {
                let mut dw = vec![0f32; w.len()];
                let dx = backward_in_bands(&g, &dy, &x, Some(&u), &mut dw, true, band)
                    .expect("dx with W");
                close("dx in bands", &g, &dx, &dx64, &dxs, 1e-5);
                close("dW in bands", &g, &dw, &dw64, &dws, 1e-5);
            }
        }
    }
    set_simd_level(SimdLevel::Avx512);
}

/// The split form and back on every level, over widths 1–700 (one block
/// of the AVX-512 split up to several groups of blocks) and paddings 0–2:
/// the same bits as the plain split, every element of the split rows
/// written, and the image back unchanged.
#[test]
fn split_planes_the_same_on_every_level() {
    let _one = level_lock();
    let levels = levels();
    let mut next = passes::seeded_ints(0x5b1);
    let mut cases: Vec<(usize, usize, usize)> = (0..60)
        .map(|_| (next(1, 9), next(1, 700), next(0, 2)))
        .collect();
    cases.extend([(1, 1, 1), (3, 1, 2), (2, 256, 1), (2, 257, 0), (2, 512, 2)]);
    for (h, w, p) in cases {
        if h + 2 * p < 3 || w + 2 * p < 3 {
            continue;
        }
        let g = geom(1, 1, h, w, 1, p);
        let t = Tiles::of(&g);
        let plane = test_values(h as u64 * 1000 + w as u64, h * w);
        let mut first: Option<Vec<f32>> = None;
        for &level in &levels {
            set_simd_level(level);
            let len = t.rows() * t.split_row();
            // NaN past the split rows and wherever a split leaves unwritten.
            let mut eo = vec![f32::NAN; len + 40];
            let mut row = vec![0f32; t.split_row()];
            planes::split(&g, &t, &plane, &mut eo, &mut row);
            let (rows, rest) = eo.split_at(len);
            assert!(
                rows.iter().all(|v| !v.is_nan()),
                "{h}×{w} p {p} {level:?}: unwritten"
            );
            assert!(
                rest.iter().all(|v| v.is_nan()),
                "{h}×{w} p {p} {level:?}: past the rows"
            );
            let mut back = vec![f32::NAN; h * w];
            planes::unsplit(&g, &t, rows, &mut back, &mut row);
            assert!(
                back.iter()
                    .zip(&plane)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{h}×{w} p {p} {level:?}: unsplit"
            );
            match &first {
                None => first = Some(rows.to_vec()),
                Some(f) => assert!(
                    f.iter().zip(rows).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{h}×{w} p {p}: {level:?} differs"
                ),
            }
        }
    }
    set_simd_level(SimdLevel::Avx512);
}
