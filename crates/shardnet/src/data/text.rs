//! Text for language models: a corpus ([`Text`]) split into training and
//! validation, made tokens by a [`Tokenizer`] ([`Corpus`]), and cut into
//! windows of T + 1 tokens ([`TextWindows`]): the input T tokens and the T
//! next ones.
//!
//! The tokens are bytes by default (a vocabulary of 256, [`BYTE_VOCAB`]),
//! so any text in any encoding is read as it is; or a BPE learned from the
//! training text ([`Tokenizer::train_bpe`]). The default corpus is Debian's
//! `fortunes` package ([`FORTUNES`]: `apt-get install fortunes`), whose
//! files hold short texts separated by lines holding `%`.
//!
//! **Records and the split.** A file is cut into records at its `%` lines
//! (a file without one is one record); the records of every file, in the
//! order of the files' names, are numbered, and every tenth (numbers 9,
//! 19, …) goes to validation, the rest to training, each set the records
//! joined by a newline. With fewer than ten records the last tenth of the
//! text's bytes is the validation set. The split depends on the corpus
//! alone: every rank and every run reads the same sets.

use super::dataset::{Batch, Dataset};
use super::Tokenizer;
use crate::{Error, Result};
use candle_core::{Device, Tensor};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where Debian's `fortunes` package puts its texts.
pub const FORTUNES: &str = "/usr/share/games/fortunes";

/// Tokens of a byte-level model.
pub const BYTE_VOCAB: usize = 256;

/// A corpus's text, split into training and validation (bytes).
#[derive(Clone, Debug)]
pub struct Text {
    /// The training text.
    pub train: Vec<u8>,
    /// The validation text.
    pub validation: Vec<u8>,
    /// Where it was read from (a file or a directory).
    pub source: PathBuf,
    /// Files read.
    pub files: usize,
}

/// A corpus as tokens, split into training and validation.
#[derive(Clone, Debug)]
pub struct Corpus {
    /// The training tokens.
    pub train: Arc<Vec<u32>>,
    /// The validation tokens.
    pub validation: Arc<Vec<u32>>,
    /// Where it was read from (a file or a directory).
    pub source: PathBuf,
    /// Files read.
    pub files: usize,
}

impl Corpus {
    /// The corpus at `path` as byte tokens ([`Text::read`]).
    pub fn read(path: Option<&Path>) -> Result<Corpus> {
        let _data = crate::heap::counting_as(crate::heap::Part::Data);
        Text::read(path)?.tokens(&Tokenizer::Bytes)
    }

    /// The corpus of `texts` as byte tokens ([`Text::from_texts`]).
    pub fn from_texts(texts: &[Vec<u8>], source: PathBuf) -> Result<Corpus> {
        Text::from_texts(texts, source).tokens(&Tokenizer::Bytes)
    }
}

impl Text {
    /// The text at `path` (a text file, or a directory whose files are
    /// read: every regular file whose name has no extension, as the
    /// fortune files are), or at [`FORTUNES`] without one. A missing
    /// corpus is an error that says what to install or give.
    pub fn read(path: Option<&Path>) -> Result<Text> {
        let _data = crate::heap::counting_as(crate::heap::Part::Data);
        let (source, flag) = match path {
            Some(p) => (p.to_path_buf(), "--corpus"),
            None => (PathBuf::from(FORTUNES), "the default corpus"),
        };
        if !source.exists() {
            return Err(Error::Io(match path {
                Some(_) => format!("--corpus {}: no such file or directory", source.display()),
                None => format!(
                    "no text corpus at {FORTUNES}: install Debian's fortunes (apt-get install \
                     fortunes), or give --corpus FILE|DIR (a text file, or a directory of them)"
                ),
            }));
        }
        let files = if source.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(&source)
                .map_err(|e| Error::caused(format!("{flag} {}", source.display()), e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && p.extension().is_none())
                .collect();
            files.sort();
            files
        } else {
            vec![source.clone()]
        };
        let mut texts = Vec::with_capacity(files.len());
        for f in &files {
            texts.push(
                std::fs::read(f)
                    .map_err(|e| Error::caused(format!("{flag}: {}", f.display()), e))?,
            );
        }
        let corpus = Self::from_texts(&texts, source.clone());
        if corpus.train.is_empty() {
            return Err(Error::Io(format!(
                "{flag} {}: no text in {} file(s) (a directory's files without an extension are \
                 read)",
                source.display(),
                files.len()
            )));
        }
        Ok(corpus)
    }

    /// The text of `texts` (each a file's bytes), split as the module doc
    /// says; `source` names it.
    pub fn from_texts(texts: &[Vec<u8>], source: PathBuf) -> Text {
        let records: Vec<&[u8]> = texts.iter().flat_map(|t| records(t)).collect();
        let (train, validation) = if records.len() >= 10 {
            let (mut train, mut val) = (Vec::new(), Vec::new());
            for (i, r) in records.iter().enumerate() {
                let set = if i % 10 == 9 { &mut val } else { &mut train };
                if !set.is_empty() {
                    set.push(b'\n');
                }
                set.extend_from_slice(r);
            }
            (train, val)
        } else {
            let all = records.join(&b'\n');
            let cut = all.len() - all.len() / 10;
            (all[..cut].to_vec(), all[cut..].to_vec())
        };
        Text {
            train,
            validation,
            source,
            files: texts.len(),
        }
    }

    /// The training text's lines (what a BPE learns from).
    pub fn train_lines(&self) -> Vec<&[u8]> {
        self.train.split(|&b| b == b'\n').collect()
    }

    /// Both sets as `tokenizer`'s tokens, one copy per process: ranks that
    /// are threads of one process and ask for the same text and tokenizer
    /// share the first one's tokens (while any of them holds them), so the
    /// process holds the data once however many ranks it runs. The others
    /// wait while the first encodes.
    pub fn shared_tokens(&self, tokenizer: &Tokenizer) -> Result<Corpus> {
        use std::hash::{Hash, Hasher};
        use std::sync::{Mutex, Weak};
        type Held = (u64, Weak<Vec<u32>>, Weak<Vec<u32>>);
        static HELD: Mutex<Vec<Held>> = Mutex::new(Vec::new());
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&self.train, &self.validation, &self.source, self.files).hash(&mut h);
        tokenizer.to_json()?.hash(&mut h);
        let key = h.finish();
        // Held while encoding: a second rank waits for the first's tokens.
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        held.retain(|(_, t, v)| t.strong_count() > 0 && v.strong_count() > 0);
        let found = held
            .iter()
            .find(|(k, ..)| *k == key)
            .and_then(|(_, t, v)| Some((t.upgrade()?, v.upgrade()?)));
        let corpus = match found {
            Some((train, validation)) => Corpus {
                train,
                validation,
                source: self.source.clone(),
                files: self.files,
            },
            None => {
                let c = self.tokens(tokenizer)?;
                held.push((key, Arc::downgrade(&c.train), Arc::downgrade(&c.validation)));
                c
            }
        };
        Ok(corpus)
    }

    /// Both sets as `tokenizer`'s tokens.
    pub fn tokens(&self, tokenizer: &Tokenizer) -> Result<Corpus> {
        let _data = crate::heap::counting_as(crate::heap::Part::Data);
        Ok(Corpus {
            train: Arc::new(tokenizer.encode(&self.train)?),
            validation: Arc::new(tokenizer.encode(&self.validation)?),
            source: self.source.clone(),
            files: self.files,
        })
    }
}

/// The records of one file: its text cut at lines that hold only `%`,
/// each without its surrounding newlines; empty records dropped.
fn records(text: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut at = 0;
    let trim =
        |r: &[u8]| -> usize { r.len() - r.iter().rev().take_while(|&&b| b == b'\n').count() };
    while at < text.len() {
        let end = text[at..]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(text.len(), |p| at + p);
        let line = &text[at..end];
        if line == b"%" || line == b"%\r" {
            let r = &text[start..at];
            out.push(&r[..trim(r)]);
            start = (end + 1).min(text.len());
        }
        at = end + 1;
    }
    let r = &text[start.min(text.len())..];
    out.push(&r[..trim(r)]);
    out.into_iter().filter(|r| !r.is_empty()).collect()
}

/// Windows of a token sequence: example i is tokens i·T .. i·T + T (the
/// input) and the same shifted by one (the targets), so the windows cover
/// the text once, without overlap. A [`Batch`]'s `x` and `t` are both
/// (B, T) `u32` token ids.
#[derive(Clone, Debug)]
pub struct TextWindows {
    tokens: Arc<Vec<u32>>,
    seq: usize,
    device: Device,
}

impl TextWindows {
    /// The windows of `seq` tokens over `tokens`, batches on `device`;
    /// refused where not one window fits (`what` names the set).
    pub fn new(tokens: Arc<Vec<u32>>, seq: usize, device: &Device, what: &str) -> Result<Self> {
        let _data = crate::heap::counting_as(crate::heap::Part::Data);
        if seq == 0 || tokens.len() < seq + 1 {
            return Err(Error::Usage(format!(
                "--seq {seq}: the {what} text has {} tokens, fewer than one window of seq + 1; \
                 give a shorter --seq or a larger --corpus",
                tokens.len()
            )));
        }
        Ok(TextWindows {
            tokens,
            seq,
            device: device.clone(),
        })
    }

    /// Tokens per window (T).
    pub fn seq(&self) -> usize {
        self.seq
    }
}

impl Dataset for TextWindows {
    fn len(&self) -> usize {
        (self.tokens.len() - 1) / self.seq
    }

    fn batch(&self, indices: &[usize]) -> Result<Batch> {
        let t = self.seq;
        let (mut x, mut y) = (Vec::with_capacity(indices.len() * t), Vec::new());
        for &i in indices {
            if i >= self.len() {
                return Err(Error::Usage(format!(
                    "text windows: example {i} of {}",
                    self.len()
                )));
            }
            x.extend_from_slice(&self.tokens[i * t..i * t + t]);
            y.extend_from_slice(&self.tokens[i * t + 1..i * t + t + 1]);
        }
        let b = indices.len();
        Ok(Batch {
            x: Some(Tensor::from_vec(x, (b, t), &self.device)?),
            t: Some(Tensor::from_vec(y, (b, t), &self.device)?),
            len: b,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_cut_at_percent_lines() {
        let r = records(b"one\nline\n%\ntwo\n%\n%\nthree");
        assert_eq!(r, vec![&b"one\nline"[..], b"two", b"three"]);
        assert_eq!(records(b"no marks\n"), vec![&b"no marks"[..]]);
        assert!(records(b"%\n%\n").is_empty());
    }

    #[test]
    fn every_tenth_record_is_validation() {
        let text: Vec<u8> = (0..20)
            .map(|i| format!("r{i}\n%\n"))
            .collect::<String>()
            .into_bytes();
        let c = Corpus::from_texts(&[text], "t".into()).unwrap();
        let s = |v: &[u32]| v.iter().map(|&b| b as u8 as char).collect::<String>();
        assert_eq!(s(&c.validation), "r9\nr19");
        assert!(s(&c.train).starts_with("r0\nr1\n"));
        assert!(!s(&c.train).contains("r9\n"));
    }

    #[test]
    fn a_short_text_keeps_its_last_tenth() {
        let c = Corpus::from_texts(&[b"abcdefghijklmnopqrst".to_vec()], "t".into()).unwrap();
        assert_eq!((c.train.len(), c.validation.len()), (18, 2));
    }

    #[test]
    fn windows_are_inputs_and_next_tokens() {
        let toks: Vec<u32> = (0..11).collect();
        let w = TextWindows::new(Arc::new(toks), 3, &Device::Cpu, "training").unwrap();
        assert_eq!(w.len(), 3);
        let b = w.batch(&[2, 0]).unwrap();
        let x = b.x.unwrap().to_vec2::<u32>().unwrap();
        let t = b.t.unwrap().to_vec2::<u32>().unwrap();
        assert_eq!(x, vec![vec![6, 7, 8], vec![0, 1, 2]]);
        assert_eq!(t, vec![vec![7, 8, 9], vec![1, 2, 3]]);
        assert!(TextWindows::new(Arc::new(vec![1, 2]), 2, &Device::Cpu, "training").is_err());
    }
}
