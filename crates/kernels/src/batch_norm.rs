//! Batch normalisation's per-channel arithmetic, for `nn::BatchNorm2d`'s
//! fused passes: the affine form of the normalisation, f64 sums over 8
//! lanes, the loops over one plane (each compiled for the CPU's widest
//! vectors), and the passes over every plane of x ([`Planes`]), the
//! gradient read a plane at a time ([`Dy`]). Safe functions on slices.

/// Per channel (scale, shift) in f32: y = x·scale + shift.
pub type Affine = (Vec<f32>, Vec<f32>);

/// The normalisation as an affine map per channel: scale = γ/√(σ² + ε),
/// shift = β − μ·scale (computed in f64, then rounded).
pub fn affine(mean: &[f64], var: &[f64], gamma: &[f32], beta: &[f32], eps: f64) -> Affine {
    (0..mean.len())
        .map(|ch| {
            let inv = 1.0 / (var[ch] + eps).sqrt();
            let scale = (inv * gamma[ch] as f64) as f32;
            let shift = (beta[ch] as f64 - mean[ch] * inv * gamma[ch] as f64) as f32;
            (scale, shift)
        })
        .unzip()
}

/// One normalised value: v·a + b, then max(0, ·) with `relu`. The one
/// formula of the plain pass and the pooling one, which must agree bit for
/// bit.
#[inline(always)]
fn normalised(v: f32, (a, b): (f32, f32), relu: bool) -> f32 {
    let y = v * a + b;
    if relu {
        y.max(0.0)
    } else {
        y
    }
}

/// Σ f(a[i], b[i]) (K sums at once) in f64 over 8 interleaved partial
/// sums — independent adds that pipeline and vectorise, where one running
/// sum waits on each add's latency — combined in a fixed order (the same
/// result on every run), the tail after.
#[inline(always)]
fn sum8<const K: usize>(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> [f64; K]) -> [f64; K] {
    let mut acc = [[0f64; 8]; K];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            let v = f(x[l], y[l]);
            for k in 0..K {
                acc[k][l] += v[k];
            }
        }
    }
    let mut out = acc.map(crate::tree8);
    for (x, y) in ta.iter().zip(tb) {
        let v = f(*x, *y);
        for k in 0..K {
            out[k] += v[k];
        }
    }
    out
}

/// The loops over one plane (hw values of one image and channel), each
/// compiled for the CPU's widest vectors ([`crate::dispatch`]).
pub mod plane {
    use super::sum8;
    use crate::dispatch;

    /// Σ v.
    pub fn sum(p: &[f32]) -> f64 {
        dispatch!(|| {
            #[inline(always)]
            fn go(p: &[f32]) -> f64 {
                sum8(p, p, |v, _| [v as f64])[0]
            }
            go(p)
        })
    }

    /// Σ (v − m)².
    pub fn centred_squares(p: &[f32], m: f64) -> f64 {
        dispatch!(|| {
            #[inline(always)]
            fn go(p: &[f32], m: f64) -> f64 {
                sum8(p, p, |v, _| [(v as f64 - m) * (v as f64 - m)])[0]
            }
            go(p, m)
        })
    }

    /// out = v·a + b, then max(0, ·) with `relu`.
    pub fn affine(out: &mut [f32], x: &[f32], (a, b): (f32, f32), relu: bool) {
        dispatch!(|| {
            #[inline(always)]
            fn go(out: &mut [f32], x: &[f32], (a, b): (f32, f32), relu: bool) {
                // Two loops, so each vectorises without a branch inside.
                if relu {
                    for (d, v) in out.iter_mut().zip(x) {
                        *d = super::normalised(*v, (a, b), true);
                    }
                } else {
                    for (d, v) in out.iter_mut().zip(x) {
                        *d = super::normalised(*v, (a, b), false);
                    }
                }
            }
            go(out, x, (a, b), relu)
        })
    }

    /// (Σ g, Σ g·(v − m)), g counted only where v·a + b > 0 with a `mask`
    /// (a, b). In sum8's lanes and order; on AVX-512 by intrinsics (the
    /// compiler keeps the masked form scalar).
    pub fn grad_sums(g: &[f32], v: &[f32], m: f64, mask: Option<(f32, f32)>) -> [f64; 2] {
        #[cfg(target_arch = "x86_64")]
        if crate::simd_level() == crate::SimdLevel::Avx512 {
            // SAFETY: the CPU has AVX-512 F and VL (simd_level).
            return unsafe { grad_sums_avx512(g, v, m, mask) };
        }
        dispatch!(|| {
            #[inline(always)]
            fn go(g: &[f32], v: &[f32], m: f64, mask: Option<(f32, f32)>) -> [f64; 2] {
                match mask {
                    Some((a, b)) => sum8(g, v, |g, v| {
                        let g = if v * a + b > 0.0 { g } else { 0.0 };
                        [g as f64, g as f64 * (v as f64 - m)]
                    }),
                    None => sum8(g, v, |g, v| [g as f64, g as f64 * (v as f64 - m)]),
                }
            }
            go(g, v, m, mask)
        })
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl")]
    unsafe fn grad_sums_avx512(g: &[f32], v: &[f32], m: f64, mask: Option<(f32, f32)>) -> [f64; 2] {
        use std::arch::x86_64::*;
        let n = g.len().min(v.len());
        let body = n / 8 * 8;
        let (mut s0, mut s1) = (_mm512_setzero_pd(), _mm512_setzero_pd());
        let mv = _mm512_set1_pd(m);
        let (a, b) = mask.unwrap_or((0.0, 0.0));
        let (av, bv, zero) = (_mm256_set1_ps(a), _mm256_set1_ps(b), _mm256_setzero_ps());
        for i in (0..body).step_by(8) {
            let mut gf = _mm256_loadu_ps(g.as_ptr().add(i));
            let vf = _mm256_loadu_ps(v.as_ptr().add(i));
            if mask.is_some() {
                // v·a + b > 0 (ordered: NaN drops g), as the scalar form.
                let t = _mm256_add_ps(_mm256_mul_ps(vf, av), bv);
                gf = _mm256_maskz_mov_ps(_mm256_cmp_ps_mask::<_CMP_GT_OQ>(t, zero), gf);
            }
            let gd = _mm512_cvtps_pd(gf);
            s0 = _mm512_add_pd(s0, gd);
            s1 = _mm512_add_pd(
                s1,
                _mm512_mul_pd(gd, _mm512_sub_pd(_mm512_cvtps_pd(vf), mv)),
            );
        }
        let (mut l0, mut l1) = ([0f64; 8], [0f64; 8]);
        _mm512_storeu_pd(l0.as_mut_ptr(), s0);
        _mm512_storeu_pd(l1.as_mut_ptr(), s1);
        let mut out = [crate::tree8(l0), crate::tree8(l1)];
        for i in body..n {
            let (gi, vi) = (g[i], v[i]);
            let gi = match mask {
                Some((a, b)) if vi * a + b > 0.0 => gi,
                Some(_) => 0.0,
                None => gi,
            };
            out[0] += gi as f64;
            out[1] += gi as f64 * (vi as f64 - m);
        }
        out
    }

    /// out = k·g − a − (v − μ)·m (the coefficients (k, a, m) and μ of one
    /// channel), g masked as in [`grad_sums`].
    pub fn input_grad(
        out: &mut [f32],
        g: &[f32],
        v: &[f32],
        coef: ((f32, f32, f64), f64),
        mask: Option<(f32, f32)>,
    ) {
        dispatch!(|| {
            #[inline(always)]
            fn go(
                out: &mut [f32],
                g: &[f32],
                v: &[f32],
                ((k, a, m), mu): ((f32, f32, f64), f64),
                mask: Option<(f32, f32)>,
            ) {
                match mask {
                    Some((sc, sh)) => {
                        for ((d, g), v) in out.iter_mut().zip(g).zip(v) {
                            let g = if v * sc + sh > 0.0 { *g } else { 0.0 };
                            *d = k * g - a - ((*v as f64 - mu) * m) as f32;
                        }
                    }
                    None => {
                        for ((d, g), v) in out.iter_mut().zip(g).zip(v) {
                            *d = k * g - a - ((*v as f64 - mu) * m) as f32;
                        }
                    }
                }
            }
            go(out, g, v, coef, mask)
        })
    }
}

/// The gradient at the fused op's output, as the backward passes read it
/// one plane (hw values) at a time.
#[derive(Clone, Copy)]
pub enum Dy<'a> {
    /// dy itself (B, C, H, W).
    Dense(&'a [f32]),
    /// After pooling: each plane's `per` pooled gradients and their
    /// winners' offsets; dy is g at the winners and zero elsewhere, as
    /// `nn::max_pool2d`'s backward would write it.
    Pooled {
        g: &'a [f32],
        win: &'a [u32],
        per: usize,
    },
}

impl<'a> Dy<'a> {
    /// `g` dense, or pooled `per` to a plane with these winners.
    pub fn of(g: &'a [f32], win: &'a [u32], per: Option<usize>) -> Self {
        match per {
            Some(per) => Dy::Pooled { g, win, per },
            None => Dy::Dense(g),
        }
    }

    /// Plane p's hw values: a view, or expanded into `buf`.
    fn plane<'b>(&self, p: usize, hw: usize, buf: &'b mut Vec<f32>) -> &'b [f32]
    where
        'a: 'b,
    {
        match *self {
            Dy::Dense(d) => &d[p * hw..(p + 1) * hw],
            Dy::Pooled { g, win, per } => {
                buf.clear();
                buf.resize(hw, 0.0);
                let at = p * per..(p + 1) * per;
                for (v, w) in g[at.clone()].iter().zip(&win[at]) {
                    buf[*w as usize] = *v;
                }
                buf
            }
        }
    }
}

/// The per-channel passes of the fused op over x (B, C, H, W) flattened:
/// channel ch is B planes of hw values, plane i at (i·C + ch)·hw. Sums
/// are in f64: each plane's by [`sum8`], the planes added in order (the
/// same on every run).
#[derive(Clone, Copy)]
pub struct Planes {
    pub b: usize,
    pub c: usize,
    pub hw: usize,
}

impl Planes {
    /// The offsets of channel ch's planes.
    fn of(self, ch: usize) -> impl Iterator<Item = usize> {
        (0..self.b).map(move |i| (i * self.c + ch) * self.hw)
    }

    /// f(ch) for every channel, split over the threads when x is large
    /// (each channel's value is computed the same way either way).
    fn per_channel<R: Send>(self, f: impl Fn(usize) -> R + Sync + Send) -> Vec<R> {
        use rayon::prelude::*;
        if crate::split_work(self.b * self.c * self.hw) {
            (0..self.c).into_par_iter().map(f).collect()
        } else {
            (0..self.c).map(f).collect()
        }
    }

    /// out[i] = f(image i's values of every input), image by image, split
    /// over the threads when large.
    fn per_image(self, out: &mut [f32], f: impl Fn(usize, &mut [f32]) + Sync + Send) {
        use rayon::prelude::*;
        let per = (self.c * self.hw).max(1);
        if crate::split_work(out.len()) {
            out.par_chunks_mut(per)
                .enumerate()
                .for_each(|(i, o)| f(i, o));
        } else {
            out.chunks_mut(per).enumerate().for_each(|(i, o)| f(i, o));
        }
    }

    /// Σ x per channel.
    pub fn sums(self, x: &[f32]) -> Vec<f64> {
        self.per_channel(|ch| self.of(ch).map(|o| plane::sum(&x[o..o + self.hw])).sum())
    }

    /// Σ (x − μ)² per channel.
    pub fn centred_squares(self, x: &[f32], mean: &[f64]) -> Vec<f64> {
        self.per_channel(|ch| {
            let m = mean[ch];
            self.of(ch)
                .map(|o| plane::centred_squares(&x[o..o + self.hw], m))
                .sum()
        })
    }

    /// y = (x − μ) / √(σ² + ε) · γ + β as x·scale + shift in f32 (the
    /// [`affine`] pair); then max(0, y) with `relu`.
    pub fn normalise(self, x: &[f32], (scale, shift): &Affine, relu: bool) -> Vec<f32> {
        // Every plane written by plane::affine.
        let mut y = crate::unfilled(x.len(), f32::NAN);
        let per = self.c * self.hw;
        self.per_image(&mut y, |i, out| {
            let x = &x[i * per..][..per];
            for (ch, (o, s)) in out.chunks_mut(self.hw).zip(x.chunks(self.hw)).enumerate() {
                plane::affine(o, s, (scale[ch], shift[ch]), relu);
            }
        });
        y
    }

    /// [`normalise`](Self::normalise) followed by k × k max pooling
    /// (`nn::max_pool2d`'s windows and winner rule), without
    /// writing the activation before the pooling: (pooled y, each output's
    /// winner as its offset in its plane).
    pub fn normalise_pool(
        self,
        x: &[f32],
        (scale, shift): &Affine,
        relu: bool,
        (h, w, k): (usize, usize, usize),
    ) -> (Vec<f32>, Vec<u32>) {
        let per = (h / k) * (w / k);
        // Every output and its winner written by the pooling.
        let mut y = crate::unfilled(self.b * self.c * per, f32::NAN);
        let mut win = crate::unfilled(y.len(), u32::MAX);
        if per == 0 {
            return (y, win);
        }
        let image = self.c * self.hw;
        let one = |(i, (y, win)): (usize, (&mut [f32], &mut [u32]))| {
            let x = &x[i * image..][..image];
            let planes = y
                .chunks_mut(per)
                .zip(win.chunks_mut(per))
                .zip(x.chunks(self.hw));
            for (ch, ((y, win), plane)) in planes.enumerate() {
                let (a, b) = (scale[ch], shift[ch]);
                if k == 2 && crate::pool::pool2_affine(plane, (a, b), relu, (h, w), y, win) {
                    continue;
                }
                // The values normalise writes.
                let value = |at: usize| normalised(plane[at], (a, b), relu);
                crate::pool::pool_plane(value, (h, w, k), y, win);
            }
        };
        crate::pool::by_parts((&mut y, &mut win), self.c * per, x.len(), one);
        (y, win)
    }

    /// (Σ dy, Σ dy·x̂) per channel, x̂ = (x − μ)·inv.
    /// With a `mask` (ReLU's, from the forward's affine pair) dy counts
    /// only where x·scale + shift > 0.
    pub fn grad_sums(
        self,
        x: &[f32],
        dy: Dy<'_>,
        mean: &[f64],
        inv: &[f64],
        mask: Option<&Affine>,
    ) -> (Vec<f64>, Vec<f64>) {
        self.per_channel(|ch| {
            let m = mean[ch];
            let mut buf = Vec::new();
            let [sdy, sdxm] = self.of(ch).fold([0f64; 2], |acc, o| {
                let g = dy.plane(o / self.hw.max(1), self.hw, &mut buf);
                let v = &x[o..o + self.hw];
                let s = plane::grad_sums(g, v, m, mask.map(|(a, b)| (a[ch], b[ch])));
                [acc[0] + s[0], acc[1] + s[1]]
            });
            (sdy, sdxm * inv[ch])
        })
        .into_iter()
        .unzip()
    }

    /// dx = γ·inv·(dy − Σdy/N − x̂·Σ(dy·x̂)/N), the sums over all N values
    /// of the channel (every rank's); dy masked as in [`Planes::grad_sums`].
    #[allow(clippy::too_many_arguments)]
    pub fn input_grad(
        self,
        x: &[f32],
        dy: Dy<'_>,
        mean: &[f64],
        inv: &[f64],
        gamma: &[f32],
        (sdy, sdyx, n): (&[f64], &[f64], f64),
        mask: Option<&Affine>,
    ) -> Vec<f32> {
        // Per channel: k = γ·inv, a = k·Σdy/N, m = k·Σ(dy·x̂)/N·inv.
        let coef: Vec<(f32, f32, f64)> = (0..self.c)
            .map(|ch| {
                let k = gamma[ch] as f64 * inv[ch];
                (
                    k as f32,
                    (k * sdy[ch] / n) as f32,
                    k * sdyx[ch] / n * inv[ch],
                )
            })
            .collect();
        // Every plane written by plane::input_grad.
        let mut dx = crate::unfilled(x.len(), f32::NAN);
        let per = self.c * self.hw;
        self.per_image(&mut dx, |i, out| {
            let x = &x[i * per..][..per];
            let mut buf = Vec::new();
            for (ch, (o, v)) in out.chunks_mut(self.hw).zip(x.chunks(self.hw)).enumerate() {
                let g = dy.plane(i * self.c + ch, self.hw, &mut buf);
                let mask = mask.map(|(sc, sh)| (sc[ch], sh[ch]));
                plane::input_grad(o, g, v, (coef[ch], mean[ch]), mask);
            }
        });
        dx
    }
}

#[cfg(test)]
mod rate {
    use super::*;
    use crate::{set_simd_level, SimdLevel};

    #[test]
    #[ignore = "a timing, run by hand"]
    fn passes() {
        let p = Planes {
            b: 32,
            c: 64,
            hw: 1024,
        };
        let n = p.b * p.c * p.hw;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let dy: Vec<f32> = (0..n)
            .map(|i| ((i * 104729) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let (mean, inv) = (vec![0.01f64; p.c], vec![1.3f64; p.c]);
        let aff: Affine = (vec![1.1f32; p.c], vec![0.1f32; p.c]);
        let gamma = vec![0.9f32; p.c];
        for level in [SimdLevel::Baseline, SimdLevel::Avx2, SimdLevel::Avx512] {
            set_simd_level(level);
            let t = |f: &mut dyn FnMut()| {
                let mut best = f64::MAX;
                for _ in 0..7 {
                    let s = std::time::Instant::now();
                    f();
                    best = best.min(s.elapsed().as_secs_f64());
                }
                best * 1e3
            };
            let a = t(&mut || drop(std::hint::black_box(p.sums(&x))));
            let b = t(&mut || drop(std::hint::black_box(p.centred_squares(&x, &mean))));
            let c = t(&mut || drop(std::hint::black_box(p.normalise(&x, &aff, true))));
            let d = t(&mut || {
                drop(std::hint::black_box(p.grad_sums(
                    &x,
                    Dy::Dense(&dy),
                    &mean,
                    &inv,
                    Some(&aff),
                )))
            });
            let sums = (vec![0.5f64; p.c], vec![0.25f64; p.c]);
            let e = t(&mut || {
                drop(std::hint::black_box(p.input_grad(
                    &x,
                    Dy::Dense(&dy),
                    &mean,
                    &inv,
                    &gamma,
                    (&sums.0, &sums.1, n as f64),
                    Some(&aff),
                )))
            });
            eprintln!(
                "{level:?}: sums {a:.2} ms, centred {b:.2}, normalise+relu {c:.2}, grad sums {d:.2}, input grad {e:.2}"
            );
        }
        set_simd_level(SimdLevel::Avx512);
    }
}
