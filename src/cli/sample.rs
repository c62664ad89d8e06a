//! `shardnet sample MODEL --prompt TEXT`: text from a trained GPT, read
//! from a checkpoint (sharded, any rank count) or a parameter file
//! (`--save-params`, `shardnet consolidate`).

use shardnet::models::gpt::{sample, SampleConfig};
use shardnet::train::checkpoint::{consolidate, find_as, read_manifest};
use shardnet::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The flags of `shardnet sample`.
#[derive(clap::Args)]
pub(crate) struct SampleArgs {
    /// A GPT's checkpoint (a step-* directory, or a --checkpoint-dir: its
    /// newest) or parameter file (safetensors: --save-params, shardnet
    /// consolidate).
    pub(crate) model: PathBuf,
    /// The text to continue.
    #[arg(long, default_value = "")]
    pub(crate) prompt: String,
    /// Tokens (bytes) to generate.
    #[arg(long, default_value_t = 200, value_parser = super::args::whole, allow_negative_numbers = true)]
    pub(crate) tokens: usize,
    /// Divide the logits by this; 0: always the most likely byte.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub(crate) temperature: f64,
    /// Draw among the K most likely bytes; 0: among all.
    #[arg(long, default_value_t = 40, value_parser = super::args::whole, allow_negative_numbers = true)]
    pub(crate) top_k: usize,
    /// Seed of the draws.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Attention heads [default: the checkpoint's --heads; a parameter file
    /// does not record them].
    #[arg(long, value_parser = super::args::at_least_one, allow_negative_numbers = true)]
    pub(crate) heads: Option<usize>,
}

/// A checkpoint's `--heads`, from its recorded settings.
fn recorded_heads(dir: &Path) -> Result<Option<usize>> {
    let manifest = read_manifest(dir)?;
    if manifest.model != "gpt" {
        return Err(Error::Usage(format!(
            "{}: a checkpoint of {}, not of a GPT",
            dir.display(),
            manifest.model
        )));
    }
    Ok(manifest
        .settings
        .iter()
        .find(|(k, _)| shardnet::train::checkpoint::field(k) == "heads")
        .and_then(|(_, v)| v.trim().parse().ok()))
}

fn load(path: &Path) -> Result<BTreeMap<String, candle_core::Tensor>> {
    let t = candle_core::safetensors::load(path, &shardnet::comm::HOST)
        .map_err(|e| Error::caused(format!("MODEL {}", path.display()), e))?;
    Ok(t.into_iter().collect())
}

/// Generate and print the prompt and what follows it.
pub(crate) fn run(a: &SampleArgs) -> Result<()> {
    let (params, recorded) = if a.model.is_file() {
        (load(&a.model)?, None)
    } else {
        let dir = find_as("MODEL", &a.model)?;
        let heads = recorded_heads(&dir)?;
        let tmp = std::env::temp_dir().join(format!(
            "shardnet-sample-{}.safetensors",
            std::process::id()
        ));
        let loaded = consolidate(&dir, &tmp).and_then(|_| load(&tmp));
        let _ = std::fs::remove_file(&tmp);
        (loaded?, heads)
    };
    let heads = a.heads.or(recorded).ok_or_else(|| {
        Error::Usage(format!(
            "MODEL {}: a parameter file does not record the attention heads; give the run's \
             --heads",
            a.model.display()
        ))
    })?;
    let cfg = SampleConfig {
        tokens: a.tokens,
        temperature: a.temperature,
        top_k: (a.top_k > 0).then_some(a.top_k),
        seed: a.seed,
    };
    let prompt: Vec<u32> = a.prompt.bytes().map(u32::from).collect();
    let ids = sample(&params, heads, &prompt, &cfg)?;
    let bytes: Vec<u8> = ids.iter().map(|&t| t as u8).collect();
    println!("{}", String::from_utf8_lossy(&bytes));
    Ok(())
}
