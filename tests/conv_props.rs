//! Property tests of the convolutions against a float64 reference written
//! from the definition (`common::conv_ref`, plain loops): `nn::Conv2d` and
//! every channel-parallel form on 1–4 thread ranks, built from given whole
//! weights, over kernels 1–5 × 1–5, strides 1–3, paddings 0–2, batches 1–5,
//! channels 1–9 and odd sizes; each entry of y, dx, dW and db within 1e-5 of
//! its Σ|terms| (the accuracy any f32 sum of those terms has, however
//! ill-conditioned). Whichever kernels the process uses: the CPU
//! kernels here, the device-generic path in `tests/generic.rs` and under
//! `SHARDNET_KERNELS=generic` (CI's second run).
//!
//! `PROPTEST_CASES=N` runs N cases a property instead of [`CASES`].

mod common;

use common::conv_ref::{check_channel_parallel, check_conv2d, geometry, FORMS};
use proptest::prelude::*;

/// Cases per property in an ordinary run.
const CASES: u32 = 96;

fn config() -> ProptestConfig {
    let default = ProptestConfig::default();
    if std::env::var_os("PROPTEST_CASES").is_some() {
        default
    } else {
        ProptestConfig {
            cases: CASES,
            ..default
        }
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn conv2d_equals_the_definition(g in geometry(), seed in 0u64..1000) {
        prop_assert_eq!(check_conv2d(&g, seed), Ok(()), "{:?}", g);
    }

    #[test]
    fn channel_parallel_forms_equal_the_definition(
        g in geometry(),
        seed in 0u64..1000,
        ranks in 1usize..=4,
        form in 0usize..FORMS.len(),
    ) {
        let form = FORMS[form];
        prop_assert_eq!(
            check_channel_parallel(&g, seed, ranks, form),
            Ok(()),
            "{:?} on {} ranks, {:?}", g, ranks, form
        );
    }
}
