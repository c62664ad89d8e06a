//! Max pooling over non-overlapping k×k windows.
//!
//! | function | forward | backward |
//! |----------|---------|----------|
//! | [`max_pool2d`] | y[b, c, i, j] = max of the k×k window at (k·i, k·j) (NaN wins) | the gradient goes to the window's first maximum (row-major), as in PyTorch |
//!
//! Shapes: x (B, C, H, W) → y (B, C, ⌊H/k⌋, ⌊W/k⌋) (trailing rows and
//! columns dropped, as PyTorch does). On the CPU `max_pool2d` is one pass
//! that remembers each window's winner; elsewhere (and with
//! `SHARDNET_KERNELS=generic`) the windows are gathered at their argmax in
//! candle ops, with the same backward.

use crate::kernels::pool::pool;
use crate::{Error, Result};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use std::sync::Mutex;

/// Max pooling with a k×k window and stride k.
pub fn max_pool2d(x: &Tensor, k: usize) -> Result<Tensor> {
    let [_, _, h, w] = x.dims()[..] else {
        return Err(Error::Usage(format!(
            "max_pool2d: input of shape {:?}, expected (batch, channels, height, width)",
            x.dims()
        )));
    };
    check_window(h, w, k)?;
    if !crate::kernels::fast(x.device()) {
        return max_pool2d_generic(x, k);
    }
    Ok(x.contiguous()?.apply_op1(MaxPool {
        k,
        winners: Mutex::new(Vec::new()),
    })?)
}

/// A k×k window must fit the h×w input (and k > 0).
pub(crate) fn check_window(h: usize, w: usize, k: usize) -> Result<()> {
    if k == 0 || h < k || w < k {
        return Err(Error::Usage(format!(
            "max_pool2d: a {k}×{k} window does not fit a {h}×{w} input"
        )));
    }
    Ok(())
}

/// The generic path in candle ops: each window laid out along a last axis,
/// its (first) argmax gathered, so the backward (gather's scatter-add)
/// sends the gradient to that element alone. (candle's own `max_pool2d`
/// backward scales the gradient by the window size, and shares it among
/// ties.)
fn max_pool2d_generic(x: &Tensor, k: usize) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let (ho, wo) = (h / k, w / k);
    if b * c == 0 {
        // No planes: candle's max cannot reduce an empty tensor; the
        // (empty) output of the right shape, still in the graph.
        return Ok(x.narrow(2, 0, ho)?.narrow(3, 0, wo)?);
    }
    let windows = x
        .narrow(2, 0, ho * k)?
        .narrow(3, 0, wo * k)?
        .reshape((b, c, ho, k, wo, k))?
        .permute((0, 1, 2, 4, 3, 5))?
        .reshape((b, c, ho, wo, k * k))?;
    // NaN wins its window, as on the CPU: a window holding one takes its
    // first NaN (candle's argmax skips NaN).
    let nan = windows.ne(&windows)?;
    let has_nan = nan.max_keepdim(4)?;
    let best = has_nan.where_cond(&nan.argmax_keepdim(4)?, &windows.argmax_keepdim(4)?)?;
    Ok(windows.gather(&best, 4)?.squeeze(4)?)
}

/// The forward op; it keeps, per output, the offset of its window's winner
/// within the input plane, for the backward.
struct MaxPool {
    k: usize,
    winners: Mutex<Vec<u32>>,
}

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        "shardnet-max-pool2d"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, c, h, w) = l.shape().dims4()?;
        if !l.is_contiguous() {
            candle_core::bail!("shardnet max_pool2d: expected a contiguous tensor");
        }
        let range = l.start_offset()..l.start_offset() + l.shape().elem_count();
        let k = self.k;
        let (y, win) = match s {
            CpuStorage::F32(v) => {
                let (y, win) = pool(&v[range], b * c, h, w, k);
                (CpuStorage::F32(y), win)
            }
            CpuStorage::F64(v) => {
                let (y, win) = pool(&v[range], b * c, h, w, k);
                (CpuStorage::F64(y), win)
            }
            _ => candle_core::bail!("shardnet max_pool2d: f32 or f64"),
        };
        *self.winners.lock().unwrap_or_else(|e| e.into_inner()) = win;
        Ok((y, Shape::from((b, c, h / k, w / k))))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (b, c, h, w) = x.dims4()?;
        let (ho, wo) = (h / self.k, w / self.k);
        let win = self.winners.lock().unwrap_or_else(|e| e.into_inner());
        if win.len() != b * c * ho * wo {
            candle_core::bail!("shardnet max_pool2d: backward before forward");
        }
        let g = grad.contiguous()?.flatten_all()?;
        let dims = (b, c, h, w);
        // Each output's gradient to its window's winner (windows do not overlap).
        fn scatter<T: Copy + Default + Send + Sync>(
            g: &[T],
            win: &[u32],
            per: usize,
            plane: usize,
            n: usize,
        ) -> Vec<T> {
            use rayon::prelude::*;
            let mut dx = vec![T::default(); n];
            if per == 0 {
                return dx;
            }
            let one = |((dx, g), win): ((&mut [T], &[T]), &[u32])| {
                for (gv, at) in g.iter().zip(win) {
                    dx[*at as usize] = *gv;
                }
            };
            if crate::kernels::split_work(n) {
                dx.par_chunks_mut(plane)
                    .zip(g.par_chunks(per))
                    .zip(win.par_chunks(per))
                    .for_each(one);
            } else {
                dx.chunks_mut(plane)
                    .zip(g.chunks(per))
                    .zip(win.chunks(per))
                    .for_each(one);
            }
            dx
        }
        let (per, plane, n) = (ho * wo, h * w, b * c * h * w);
        Ok(Some(match g.dtype() {
            candle_core::DType::F32 => Tensor::from_vec(
                scatter(&g.to_vec1::<f32>()?, &win, per, plane, n),
                dims,
                x.device(),
            )?,
            _ => Tensor::from_vec(
                scatter(&g.to_vec1::<f64>()?, &win, per, plane, n),
                dims,
                x.device(),
            )?,
        }))
    }
}
