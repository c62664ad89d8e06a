//! `shardnet sample MODEL --prompt TEXT`: text from a trained GPT, read
//! from a checkpoint (sharded, any rank count) or a parameter file
//! (`--save-params`, `shardnet consolidate`), with its tokenizer: bytes,
//! or the BPE `tokenizer.json` saved beside it.

use shardnet::data::{Tokenizer, BYTE_VOCAB, TOKENIZER_FILE};
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
    /// Tokens to generate (bytes, or BPE tokens).
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
    /// The model's BPE tokenizer.json [default: the one beside MODEL: in
    /// its --checkpoint-dir, or NAME.tokenizer.json beside NAME.safetensors;
    /// bytes for a model of 256 tokens].
    #[arg(long)]
    pub(crate) tokenizer: Option<PathBuf>,
}

/// MODEL's tokenizer: `--tokenizer`, else a `tokenizer.json` where
/// training saves it, else bytes for a vocabulary of 256; a model of
/// another vocabulary without one is an error saying where it looked.
fn tokenizer_of(a: &SampleArgs, checkpoint: Option<&Path>, vocab: usize) -> Result<Tokenizer> {
    if let Some(f) = &a.tokenizer {
        return Tokenizer::read(f);
    }
    let places: Vec<PathBuf> = match checkpoint {
        Some(dir) => [Some(dir), dir.parent()]
            .into_iter()
            .flatten()
            .map(|d| d.join(TOKENIZER_FILE))
            .collect(),
        None => vec![Tokenizer::path_beside(&a.model)],
    };
    if let Some(f) = places.iter().find(|f| f.is_file()) {
        return Tokenizer::read(f);
    }
    if vocab == BYTE_VOCAB {
        return Ok(Tokenizer::Bytes);
    }
    Err(Error::Usage(format!(
        "MODEL {} has a vocabulary of {vocab} tokens (a BPE), but its tokenizer is not at {}: \
         give --tokenizer FILE (the run's tokenizer.json)",
        a.model.display(),
        places
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" or ")
    )))
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
    let (params, recorded, checkpoint) = if a.model.is_file() {
        (load(&a.model)?, None, None)
    } else {
        let dir = find_as("MODEL", &a.model)?;
        let heads = recorded_heads(&dir)?;
        let tmp = std::env::temp_dir().join(format!(
            "shardnet-sample-{}.safetensors",
            std::process::id()
        ));
        let loaded = consolidate(&dir, &tmp).and_then(|_| load(&tmp));
        let _ = std::fs::remove_file(&tmp);
        (loaded?, heads, Some(dir))
    };
    let vocab = params
        .get("transformer.wte.weight")
        .map_or(Ok(BYTE_VOCAB), |w| w.dims2().map(|d| d.0))?;
    let tokenizer = tokenizer_of(a, checkpoint.as_deref(), vocab)?;
    if tokenizer.vocab_size() > vocab {
        return Err(Error::Usage(format!(
            "the tokenizer has {} tokens, the model {vocab}: not the model's tokenizer",
            tokenizer.vocab_size()
        )));
    }
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
    // An empty prompt starts as a text does: after a newline.
    let prompt = if a.prompt.is_empty() { "\n" } else { &a.prompt };
    let ids = sample(&params, heads, &tokenizer.encode(prompt.as_bytes())?, &cfg)?;
    // A row of the model's vocabulary that the BPE never filled (its text
    // had fewer merges to learn) stands for no text.
    let known: Vec<u32> = ids
        .into_iter()
        .filter(|&i| (i as usize) < tokenizer.vocab_size())
        .collect();
    let bytes = tokenizer.decode(&known)?;
    println!("{}", String::from_utf8_lossy(&bytes));
    Ok(())
}
