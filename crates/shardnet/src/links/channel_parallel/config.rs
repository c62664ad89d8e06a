//! What a model's configuration says about a channel-parallel convolution:
//! how its channels are split ([`ChannelSplit`], parsed from and shown as
//! the command line's words), its kernel's size ([`KernelSize`]) and the
//! knobs every channel-parallel layer takes ([`ConvConfig`]).

use std::str::FromStr;

/// How a convolution's channels are split over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ChannelSplit {
    /// Not split: every rank holds the whole convolution (replicated).
    None,
    /// ChainerMN's `ParallelConvolution2D`: a grouped convolution over
    /// interleaved input channels.
    Grouped,
    /// Exact, output channels split ([`OutputParallelConv2d`](crate::links::OutputParallelConv2d)).
    Output,
    /// Exact, input channels split ([`InputParallelConv2d`](crate::links::InputParallelConv2d)).
    Input,
}

impl FromStr for ChannelSplit {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(ChannelSplit::None),
            "grouped" => Ok(ChannelSplit::Grouped),
            "output" => Ok(ChannelSplit::Output),
            "input" => Ok(ChannelSplit::Input),
            _ => Err(format!(
                "unknown channel split {s:?}: give none, grouped, output or input"
            )),
        }
    }
}

impl std::fmt::Display for ChannelSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ChannelSplit::None => "none",
            ChannelSplit::Grouped => "grouped",
            ChannelSplit::Output => "output",
            ChannelSplit::Input => "input",
        })
    }
}

/// A kernel's height and width: `3` is 3×3, `(3, 5)` 3 high and 5 wide
/// (as [`Conv2d`](crate::nn::Conv2d) takes them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSize {
    /// Rows.
    pub h: usize,
    /// Columns.
    pub w: usize,
}

impl From<usize> for KernelSize {
    fn from(k: usize) -> Self {
        KernelSize { h: k, w: k }
    }
}

impl From<(usize, usize)> for KernelSize {
    fn from((h, w): (usize, usize)) -> Self {
        KernelSize { h, w }
    }
}

/// What a channel-parallel convolution takes besides its channels, as
/// candle-nn's `Conv2dConfig`: kernel, stride, padding, whether it has a
/// bias, and the layer's index in its model (the seed of its initial
/// values). The default is a 3×3 "same" convolution with bias (stride 1,
/// padding 1), VGG's, as layer 0.
///
/// ```
/// use shardnet::links::ConvConfig;
/// let strided = ConvConfig::new().with_stride(2).with_layer(4);
/// assert_eq!((strided.kernel.h, strided.padding, strided.bias), (3, 1, true));
/// assert_eq!(strided, ConvConfig { stride: 2, layer: 4, ..ConvConfig::default() });
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvConfig {
    /// The kernel: `3.into()` for 3×3, `(3, 5).into()`.
    pub kernel: KernelSize,
    /// The stride, both directions.
    pub stride: usize,
    /// Zero padding, both directions.
    pub padding: usize,
    /// Whether the layer has a bias.
    pub bias: bool,
    /// The layer's index in its model: the seed of its initial values.
    pub layer: usize,
}

impl Default for ConvConfig {
    fn default() -> Self {
        ConvConfig {
            kernel: KernelSize { h: 3, w: 3 },
            stride: 1,
            padding: 1,
            bias: true,
            layer: 0,
        }
    }
}

impl ConvConfig {
    /// A 3×3 "same" convolution with bias, layer 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The kernel: `3` or `(3, 5)`.
    pub fn with_kernel(mut self, kernel: impl Into<KernelSize>) -> Self {
        self.kernel = kernel.into();
        self
    }

    /// The stride, both directions.
    pub fn with_stride(mut self, stride: usize) -> Self {
        self.stride = stride;
        self
    }

    /// Zero padding, both directions.
    pub fn with_padding(mut self, padding: usize) -> Self {
        self.padding = padding;
        self
    }

    /// With or without a bias.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// The layer's index in its model (its seed).
    pub fn with_layer(mut self, layer: usize) -> Self {
        self.layer = layer;
        self
    }
}
