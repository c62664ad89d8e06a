//! How text becomes tokens ([`Tokenizer`]): bytes, or a byte-level BPE
//! trained on the training text with Hugging Face's `tokenizers` (GPT-2's
//! scheme: the 256 bytes first, then the merges learned from the text).
//!
//! | tokenizer | vocabulary | a token is | saved as |
//! |---|---|---|---|
//! | [`Tokenizer::Bytes`] | 256 ([`BYTE_VOCAB`](super::BYTE_VOCAB)) | a byte | nothing to save |
//! | [`Tokenizer::Bpe`] | at most the size asked for (≥ 257) | a byte or a merge of two tokens | `tokenizer.json` (the `tokenizers` library's file, which Python's `tokenizers.Tokenizer.from_file` reads too) |
//!
//! BPE reads text as UTF-8: a byte sequence that is not UTF-8 is read
//! with U+FFFD in place of each bad sequence (its three bytes, then, come
//! back from decoding). Every byte value is in the vocabulary, so any text
//! can be encoded.

use super::BYTE_VOCAB;
use crate::{Error, Result};
use std::str::FromStr;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::TokenizerBuilder;

/// The file a BPE tokenizer is saved in beside checkpoints.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Text to tokens and back.
#[derive(Clone)]
pub enum Tokenizer {
    /// Each byte a token.
    Bytes,
    /// Byte-level BPE.
    Bpe(Box<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Bytes => write!(f, "Tokenizer::Bytes"),
            Tokenizer::Bpe(t) => write!(f, "Tokenizer::Bpe({} tokens)", t.get_vocab_size(true)),
        }
    }
}

fn bpe_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Usage(format!("BPE tokenizer: {what}: {e}"))
}

impl Tokenizer {
    /// A byte-level BPE of at most `vocab` tokens learned from `texts` (the
    /// training text's records): the 256 bytes, then merges of pairs seen
    /// at least twice, most frequent first. The same texts give the same
    /// tokenizer.
    ///
    /// ```
    /// use shardnet::data::Tokenizer;
    /// let text = "the cat sat on the mat; the cat ate the rat";
    /// let t = Tokenizer::train_bpe(&[text.as_bytes()], 270)?;
    /// let ids = t.encode(text.as_bytes())?;
    /// assert!(ids.len() < text.len());
    /// assert_eq!(t.decode(&ids)?, text.as_bytes());
    /// # Ok::<(), shardnet::Error>(())
    /// ```
    pub fn train_bpe(texts: &[&[u8]], vocab: usize) -> Result<Tokenizer> {
        if vocab <= BYTE_VOCAB {
            return Err(Error::Usage(format!(
                "--vocab-size {vocab}: a BPE holds the {BYTE_VOCAB} bytes and its merges: give \
                 more than {BYTE_VOCAB}"
            )));
        }
        let mut trainer = BpeTrainerBuilder::new()
            .show_progress(false)
            .vocab_size(vocab)
            .min_frequency(2)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build();
        let byte_level = ByteLevel::new(false, true, true);
        let mut tok = TokenizerBuilder::<
            BPE,
            NormalizerWrapper,
            ByteLevel,
            PostProcessorWrapper,
            ByteLevel,
        >::new()
        .with_model(BPE::default())
        .with_pre_tokenizer(Some(byte_level))
        .with_decoder(Some(byte_level))
        .build()
        .map_err(|e| bpe_error("building", e))?;
        let texts: Vec<String> = texts
            .iter()
            .map(|t| String::from_utf8_lossy(t).into_owned())
            .collect();
        tok.train(&mut trainer, texts.iter())
            .map_err(|e| bpe_error("training", e))?;
        let json = tok.to_string(false).map_err(|e| bpe_error("saving", e))?;
        Self::from_json(&json)
    }

    /// A tokenizer from its JSON (what [`Tokenizer::to_json`] and
    /// `tokenizer.json` files hold).
    pub fn from_json(json: &str) -> Result<Tokenizer> {
        let t = tokenizers::Tokenizer::from_str(json).map_err(|e| bpe_error("reading", e))?;
        Ok(Tokenizer::Bpe(Box::new(t)))
    }

    /// A `tokenizer.json` file's tokenizer.
    pub fn read(path: &std::path::Path) -> Result<Tokenizer> {
        let json = std::fs::read_to_string(path)
            .map_err(|e| Error::caused(format!("tokenizer {}", path.display()), e))?;
        Self::from_json(&json).map_err(|e| Error::Usage(format!("{}: {e}", path.display())))
    }

    /// The JSON of a BPE (`None` for bytes: nothing to save).
    pub fn to_json(&self) -> Result<Option<String>> {
        match self {
            Tokenizer::Bytes => Ok(None),
            Tokenizer::Bpe(t) => t
                .to_string(false)
                .map(Some)
                .map_err(|e| bpe_error("saving", e)),
        }
    }

    /// Where the tokenizer of a parameter file `params` is saved beside it:
    /// `model.safetensors` → `model.tokenizer.json`.
    pub fn path_beside(params: &std::path::Path) -> std::path::PathBuf {
        params.with_extension(TOKENIZER_FILE)
    }

    /// How many tokens it has.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => BYTE_VOCAB,
            Tokenizer::Bpe(t) => t.get_vocab_size(true),
        }
    }

    /// The tokens of `text`.
    pub fn encode(&self, text: &[u8]) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Bytes => Ok(text.iter().map(|&b| u32::from(b)).collect()),
            Tokenizer::Bpe(t) => Ok(t
                .encode(String::from_utf8_lossy(text).as_ref(), false)
                .map_err(|e| bpe_error("encoding", e))?
                .get_ids()
                .to_vec()),
        }
    }

    /// The text of `ids` (a token it does not have is an error).
    pub fn decode(&self, ids: &[u32]) -> Result<Vec<u8>> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.vocab_size()) {
            return Err(Error::Usage(format!(
                "token {bad} is not in the tokenizer's {} tokens",
                self.vocab_size()
            )));
        }
        match self {
            Tokenizer::Bytes => Ok(ids.iter().map(|&t| t as u8).collect()),
            Tokenizer::Bpe(t) => Ok(t
                .decode(ids, false)
                .map_err(|e| bpe_error("decoding", e))?
                .into_bytes()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn corpus() -> Vec<&'static [u8]> {
        vec![
            b"A penny saved is a penny earned.".as_slice(),
            b"The early bird catches the worm; the second mouse gets the cheese.",
            b"To be or not to be, that is the question.\nWhether 'tis nobler...",
            b"Brevity is the soul of wit. Wit is the salt of conversation.",
        ]
    }

    #[test]
    fn training_is_deterministic_and_saved_whole() {
        let a = Tokenizer::train_bpe(&corpus(), 300).unwrap();
        let b = Tokenizer::train_bpe(&corpus(), 300).unwrap();
        let (ja, jb) = (a.to_json().unwrap().unwrap(), b.to_json().unwrap().unwrap());
        assert_eq!(ja, jb);
        assert!(
            a.vocab_size() > BYTE_VOCAB && a.vocab_size() <= 300,
            "{a:?}"
        );
        let c = Tokenizer::from_json(&ja).unwrap();
        let text = b"the penny is the question";
        assert_eq!(c.encode(text).unwrap(), a.encode(text).unwrap());
        assert!(Tokenizer::train_bpe(&corpus(), 256).is_err());
        assert!(Tokenizer::from_json("{").is_err());
        assert!(a.decode(&[100_000]).is_err());
    }

    proptest! {
        /// Any UTF-8 text comes back from decoding its tokens, and merges
        /// make it no longer than its bytes.
        #[test]
        fn round_trip(text in "[ -~\n\u{e9}\u{3b1}\u{4e2d}]{0,80}") {
            let t = Tokenizer::train_bpe(&corpus(), 290).unwrap();
            let ids = t.encode(text.as_bytes()).unwrap();
            prop_assert!(ids.len() <= text.len());
            prop_assert_eq!(t.decode(&ids).unwrap(), text.as_bytes());
            let bytes = Tokenizer::Bytes;
            prop_assert_eq!(bytes.decode(&bytes.encode(text.as_bytes()).unwrap()).unwrap(), text.as_bytes());
        }
    }
}
