use super::blocking::blocking;
use super::driver::IN_PLACE;
use super::*;
use crate::test_values as values;

/// The sums in f64 of C0 (if accumulating) + A · B.
fn reference(
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    la: Layout,
    b: &[f32],
    lb: Layout,
) -> Vec<f64> {
    let mut c = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k)
                .map(|p| a[la.at(i, p)] as f64 * b[lb.at(p, j)] as f64)
                .sum();
        }
    }
    c
}

/// Every (microkernel, case, accumulate, images) of `cases`.
fn runs(
    cases: &[(usize, usize, usize, usize)],
) -> impl Iterator<Item = (Micro, (usize, usize, usize, usize), bool, bool)> + '_ {
    micros().into_iter().flat_map(move |micro| {
        cases.iter().flat_map(move |&case| {
            [(false, false), (false, true), (true, false), (true, true)]
                .map(|(accumulate, images)| (micro, case, accumulate, images))
        })
    })
}

/// B (k × n) and C0 (m × n), both strided or both laid out as images
/// of `hw`: (B's layout, B, C's layout, C0).
fn operands(
    (m, n, k): (usize, usize, usize),
    hw: usize,
    images: bool,
) -> (Layout, Vec<f32>, Layout, Vec<f32>) {
    let (lb, lc) = if images {
        (Layout::images(k, hw), Layout::images(m, hw))
    } else {
        (Layout::strided(n + 3, 1), Layout::strided(n + 1, 1))
    };
    (lb, values(2, lb.span(k, n)), lc, values(3, lc.span(m, n)))
}

/// C within 1e-5·√(k + 1) of the f64 sums (plus C0 when `accumulate`).
fn assert_sums(
    what: &str,
    (m, n, k): (usize, usize, usize),
    (c, c0, lc): (&[f32], &[f32], Layout),
    sums: &[f64],
    accumulate: bool,
) {
    for i in 0..m {
        for j in 0..n {
            let w = sums[i * n + j]
                + if accumulate {
                    c0[lc.at(i, j)] as f64
                } else {
                    0.0
                };
            let got = c[lc.at(i, j)] as f64;
            let bound = 1e-5 * (k as f64 + 1.0).sqrt() * (1.0 + w.abs());
            assert!(
                (got - w).abs() <= bound,
                "{what} at ({i}, {j}): {got} against {w}"
            );
        }
    }
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}

/// A C whose rows overlap is refused before anything is written (the
/// threads' disjoint columns rely on it).
#[test]
#[should_panic(expected = "two elements in one place")]
fn refuses_a_c_whose_rows_overlap() {
    let Some(micro) = Micro::now() else {
        panic!("two elements in one place (no microkernel to test)");
    };
    let (m, n, k) = (3, 8, 2);
    let a = values(1, m * k);
    let b = values(2, k * n);
    let mut c = vec![0f32; 64];
    let packed = PackedA::new(micro, m, k, &a, Layout::strided(k, 1));
    let src = Matrix {
        b: &b,
        k,
        n,
        layout: Layout::strided(n, 1),
    };
    gemm(&packed, &src, Out::rows(&mut c, n - 1), false);
}

/// Every microkernel against the f64 sums: tiles whole and cut, k
/// below, at and across a block of k, columns across a panel, strided and images
/// layouts for B and C, overwrite and accumulate.
#[test]
fn matches_the_f64_sums_on_every_microkernel() {
    let depth = blocking().kc;
    let cases = [
        (1, 1, 1, 1),
        (12, 32, 16, 32),
        (13, 33, 257, 11),
        (7, 5, 3, 4),
        (25, 600, 300, 64),
        (5, 70, depth, 16),
        (30, 70, depth + 1, 16),
        (6, 40, 2 * depth + 6, 8),
        (3, 1030, 40, 1030),
        // Last tiles of 4 and 2 rows (their own microkernels).
        (4, 64, 64, 64),
        (10, 70, 40, 16),
        (14, 65, depth + 2, 8),
        // An A large enough to be packed over the threads.
        (200, 40, depth + 5, 8),
    ];
    for (micro, (m, n, k, hw), accumulate, images) in runs(&cases) {
        let la = Layout::strided(1, m + 2); // A column-major
        let a = values(1, la.span(m, k));
        let (lb, b, lc, c0) = operands((m, n, k), hw, images);
        let mut c = c0.clone();
        let packed = PackedA::new(micro, m, k, &a, la);
        let src = Matrix {
            b: &b,
            k,
            n,
            layout: lb,
        };
        let out = Out {
            c: &mut c,
            layout: lc,
        };
        gemm(&packed, &src, out, accumulate);
        // B packed strip by strip instead of read in place: the same
        // bits.
        IN_PLACE.store(false, std::sync::atomic::Ordering::Relaxed);
        let mut again = c0.clone();
        let out = Out {
            c: &mut again,
            layout: lc,
        };
        gemm(&packed, &src, out, accumulate);
        IN_PLACE.store(true, std::sync::atomic::Ordering::Relaxed);
        let what = format!("{micro:?} {m}×{n}×{k} images {images} accumulate {accumulate}");
        assert!(
            same_bits(&c, &again),
            "{what}: B in place differs from B packed"
        );
        let sums = reference((m, n, k), &a, la, &b, lb);
        assert_sums(&what, (m, n, k), (&c, &c0, lc), &sums, accumulate);
    }
}

/// A read where it lies ([`gemm_rows`]): the same bits as [`gemm`] on
/// A packed, and the f64 sums, on every microkernel: a last strip of
/// fewer than MR rows (its missing rows must not be read past A), k
/// below, at and across a block of k and not a multiple of 8, B with its rows
/// contiguous and with its columns contiguous (Vᵀ: packed by 8 × 8
/// transposes and their edges), columns not a multiple of 8.
#[test]
fn rows_read_in_place_match_a_packed() {
    let depth = blocking().kc;
    let cases = [
        (1, 1, 1, 1),
        (7, 5, 3, 4),
        (6, 64, 64, 64),
        (13, 33, 257, 11),
        (20, 70, depth + 9, 16),
        (64, 130, 64, 8),
        (11, 17, 2 * depth + 3, 5),
        // Vᵀ packed by 16 × 16 blocks with 8 × 8 ones beside and below.
        (9, 40, 56, 8),
        // The packed A it is held to: over the threads.
        (200, 40, depth + 5, 8),
    ];
    for (micro, (m, n, k, _), accumulate, columns) in runs(&cases) {
        let lda = k + 3;
        let a = values(1, (m - 1) * lda + k);
        let lb = if columns {
            Layout::strided(1, k + 2)
        } else {
            Layout::strided(n + 3, 1)
        };
        let b = values(2, lb.span(k, n));
        let lc = Layout::strided(n + 1, 1);
        let c0 = values(3, lc.span(m, n));
        let src = Matrix {
            b: &b,
            k,
            n,
            layout: lb,
        };
        let mut c = c0.clone();
        let rows = Rows { a: &a, m, k, lda };
        let out = Out {
            c: &mut c,
            layout: lc,
        };
        gemm_rows(micro, rows, &src, out, accumulate);
        let la = Layout::strided(lda, 1);
        let mut want = c0.clone();
        let out = Out {
            c: &mut want,
            layout: lc,
        };
        gemm(&PackedA::new(micro, m, k, &a, la), &src, out, accumulate);
        let what = format!(
            "{micro:?} {m}×{n}×{k} B's columns contiguous {columns} accumulate {accumulate}"
        );
        assert!(same_bits(&c, &want), "{what}: in place differs from packed");
        let sums = reference((m, n, k), &a, la, &b, lb);
        assert_sums(&what, (m, n, k), (&c, &c0, lc), &sums, accumulate);
    }
}

/// Aᵀ · B read across a packed A: the same bits as [`gemm`] on Aᵀ
/// packed, and the f64 sums, on every microkernel: A's rows within
/// one strip and across strips, its columns across blocks of k (a
/// block of 512 ends in a tile of 2 rows, one of 256 in a tile of 4),
/// C's k blocks starting inside a strip (512 = 85·6 + 2), B and C in
/// both layouts. The
/// slack past A is NaN: a tile's unstored rows must stay unstored.
#[test]
fn transposed_reads_across_the_packed_a() {
    let depth = blocking().kc;
    // (rows of A, columns of A, columns of B, plane of an image)
    let cases = [
        (1, 1, 1, 1),
        (7, 5, 33, 11),
        (6, 6, 64, 64),
        (12, 260, 70, 16),
        (300, depth + 1, 65, 13),
        (depth + 5, 31, 128, 64),
        (7, 2 * depth + 3, 20, 4),
    ];
    for (micro, (am, ak, n, hw), accumulate, images) in runs(&cases) {
        let la = Layout::strided(ak + 1, 1);
        let a = values(1, la.span(am, ak));
        // C (ak × n) = Aᵀ (ak × am) · B (am × n).
        let (m, k) = (ak, am);
        let lt = Layout::strided(1, ak + 1);
        let (lb, b, lc, c0) = operands((m, n, k), hw, images);
        let src = Matrix {
            b: &b,
            k,
            n,
            layout: lb,
        };
        let mut packed = PackedA::new(micro, am, ak, &a, la);
        let len = Place::of(micro, am, ak).len();
        packed.data.truncate(len);
        packed.data.resize(len + ACROSS_SLACK, f32::NAN);
        let mut c = c0.clone();
        let out = Out {
            c: &mut c,
            layout: lc,
        };
        gemm_transposed(&packed, &src, out, accumulate);
        let mut want = c0.clone();
        let out = Out {
            c: &mut want,
            layout: lc,
        };
        gemm(&PackedA::new(micro, m, k, &a, lt), &src, out, accumulate);
        let what =
            format!("{micro:?} A {am}×{ak}, n {n}, images {images}, accumulate {accumulate}");
        assert!(
            same_bits(&c, &want),
            "{what}: read across differs from Aᵀ packed"
        );
        let sums = reference((m, n, k), &a, lt, &b, lb);
        assert_sums(&what, (m, n, k), (&c, &c0, lc), &sums, accumulate);
    }
}
