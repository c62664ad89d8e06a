//! Our layers as candle-nn modules: every layer whose forward is x → y
//! implements [`candle_nn::Module`] (and [`candle_nn::ModuleT`] where
//! training and evaluation differ), so it drops into a candle-nn model
//! (`candle_nn::seq()`, a user's own `Module`). The trait's forward is the
//! layer's own; an error keeps its kind through candle and back
//! ([`crate::Error`]'s conversions).

/// `impl candle_nn::Module` for each type, calling its own
/// `forward(&self, &Tensor) -> crate::Result<Tensor>`.
macro_rules! candle_module {
    ($($t:ty),* $(,)?) => {$(
        impl candle_nn::Module for $t {
            fn forward(&self, xs: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
                Ok(<$t>::forward(self, xs)?)
            }
        }
    )*};
}
pub(crate) use candle_module;
