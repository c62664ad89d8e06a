//! Chains: the sharded layers as users combine them — two and three in a
//! row, with the layers users put before and between them — against the
//! same network on one device in f64.
//!
//! | chain | forms |
//! |-------|-------|
//! | channel-parallel | ChainerMN's grouped (own losses), grouped `.replicated()` (one loss, also after a plain `Conv2d`), output, input, their sharded forms (output-sharded → input-sharded → …, gathered at the end), and mixes |
//! | tensor-parallel | column → row, row → column, embedding → column, and three-layer forms |
//!
//! Every rank compares what *it* sees, never a sum over ranks: its dL/dx
//! (the whole one-device gradient; with ChainerMN's own losses, its input
//! channels r, r+n, … of the summed losses' gradient and zeros elsewhere),
//! the gradient of each of its own parameters against its slice of the
//! one-device gradient (a grouped convolution's: its rows and channels of
//! the dense weight's), and each layer's whole weight and gradient gathered
//! with `whole` — error ≤ 1e-5 of the largest |value| of the whole tensor
//! compared (f32 against f64; a slice is judged against its whole
//! tensor's scale, not its own, which for one channel of a cancelling sum
//! says little). tanh between the
//! layers (smooth: no kink to land on differently in f32 and f64).
//! Kernels are non-square and strided, with unequal remainders
//! (H + 2p − kh) mod s ≠ (W + 2p − kw) mod s; widths are uneven, and on 4
//! ranks some ranks hold no channels or features of a layer. The 3-layer
//! chains are built from given whole weights (`from_weights`), the 2-layer
//! ones from seeds.
//!
//! The one-device convolution is written here from its definition (a sum
//! of index-selected shifted windows, [`reference_conv2d`]), so candle's own
//! conv2d backward is not what the references rest on.
//!
//! `conv` holds the channel-parallel chains, `dense` the tensor-parallel
//! ones, `common` what both share.

mod common;
mod conv;
mod dense;

pub use conv::reference_conv2d;

use super::autograd::Case;
use conv::{conv_chain, Conv};
use dense::{dense_chain, Dense};

/// Every case.
pub fn cases() -> Vec<Case> {
    use Conv::*;
    let convs: [(&str, &[Conv]); 16] = [
        ("grouped_own_losses", &[Grouped, Grouped]),
        ("grouped_own_losses", &[Grouped, Grouped, Grouped]),
        ("grouped_one_loss", &[GroupedOneLoss, GroupedOneLoss]),
        (
            "grouped_one_loss",
            &[GroupedOneLoss, GroupedOneLoss, GroupedOneLoss],
        ),
        ("conv2d_then_grouped_one_loss", &[Plain, GroupedOneLoss]),
        (
            "conv2d_then_grouped_one_loss",
            &[Plain, GroupedOneLoss, GroupedOneLoss],
        ),
        ("output", &[Output, Output]),
        ("output", &[Output, Output, Output]),
        ("input", &[Input, Input]),
        ("input", &[Input, Input, Input]),
        (
            "output_sharded_then_input_sharded",
            &[OutputSharded, InputSharded],
        ),
        (
            "output_sharded_then_input_sharded",
            &[OutputSharded, InputSharded, InputSharded],
        ),
        ("input_then_output", &[Input, Output]),
        (
            "output_input_grouped_one_loss",
            &[Output, Input, GroupedOneLoss],
        ),
        ("grouped_one_loss_then_conv2d", &[GroupedOneLoss, Plain]),
        (
            "output_sharded_then_conv2d",
            &[OutputSharded, Plain, Output],
        ),
    ];
    let mut all: Vec<Case> = Vec::new();
    for (name, forms) in convs {
        let forms = forms.to_vec();
        all.push((
            format!("chain_{}_{name}_vs_one_device", forms.len()),
            Box::new(move |c| conv_chain(c, &forms)),
        ));
    }
    use Dense::*;
    let denses: [(&str, &[Dense]); 6] = [
        ("column_row", &[Column, Row]),
        ("column_row_column", &[Column, Row, ColumnGathered]),
        ("row_column", &[RowWhole, ColumnGathered]),
        ("row_column_row", &[RowWhole, Column, Row]),
        ("embedding_column", &[Embedding, ColumnGathered]),
        ("embedding_column_row", &[Embedding, Column, Row]),
    ];
    for (name, forms) in denses {
        let forms = forms.to_vec();
        all.push((
            format!("chain_{name}_vs_one_device"),
            Box::new(move |c| dense_chain(c, &forms)),
        ));
    }
    all
}
