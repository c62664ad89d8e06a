//! The safetensors header parser (fuzzed): each tensor's shape and where
//! its data lies, and the file's `__metadata__`.

use super::*;

/// One tensor of a safetensors file: its shape and where its data starts
/// (bytes from the file's start).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileTensor {
    /// Its shape.
    pub shape: Vec<usize>,
    /// Byte offset of its first value in the file.
    pub start: u64,
}

/// The f32 tensors of a safetensors file from its first bytes (`head`: at
/// least the 8-byte length and the header) and its length; `name` names
/// the file in errors. Any other dtype, an offset outside the file, a size
/// that does not match the shape, overlapping tensors, or a header that is
/// not JSON is an error, never a panic.
pub fn parse_safetensors_header(
    head: &[u8],
    file_len: u64,
    name: &str,
) -> Result<BTreeMap<String, FileTensor>> {
    let bad = |why: String| Error::Io(format!("{name}: {why}"));
    let Some(len) = head.get(..8) else {
        return Err(bad(format!(
            "{} bytes: too short for a safetensors file",
            head.len()
        )));
    };
    let n = u64::from_le_bytes([
        len[0], len[1], len[2], len[3], len[4], len[5], len[6], len[7],
    ]);
    if n > MAX_HEADER || 8 + n > file_len {
        return Err(bad(format!(
            "header of {n} bytes in a file of {file_len}: not a safetensors file, or truncated"
        )));
    }
    let Some(text) = head.get(8..8 + n as usize) else {
        return Err(bad("truncated header".into()));
    };
    let v: serde_json::Value = serde_json::from_slice(text)
        .map_err(|e| bad(format!("the safetensors header is not JSON ({e})")))?;
    let serde_json::Value::Object(map) = v else {
        return Err(bad("the safetensors header is not a JSON object".into()));
    };
    let data = 8 + n;
    let mut out = BTreeMap::new();
    let mut spans = Vec::new();
    for (key, e) in map {
        if key == "__metadata__" {
            continue;
        }
        let dtype = e.get("dtype").and_then(|d| d.as_str()).unwrap_or("");
        if dtype != "F32" {
            return Err(bad(format!(
                "tensor {key} is '{dtype}', checkpoints hold F32"
            )));
        }
        let shape: Option<Vec<usize>> = e.get("shape").and_then(|s| s.as_array()).and_then(|a| {
            a.iter()
                .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                .collect()
        });
        let offsets: Option<Vec<u64>> = e
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect());
        let (Some(shape), Some(offsets)) = (shape, offsets) else {
            return Err(bad(format!("tensor {key}: no valid shape or data_offsets")));
        };
        let [a, b] = offsets[..] else {
            return Err(bad(format!("tensor {key}: data_offsets needs 2 values")));
        };
        let want = shape
            .iter()
            .try_fold(4u64, |acc, &d| acc.checked_mul(d as u64));
        if b < a || Some(b - a) != want || data.checked_add(b).is_none_or(|end| end > file_len) {
            return Err(bad(format!(
                "tensor {key}: bytes {a}..{b} for shape {shape:?} in a file of {file_len} bytes \
                 (truncated or corrupt)"
            )));
        }
        spans.push((a, b, key.clone()));
        out.insert(
            key,
            FileTensor {
                shape,
                start: data + a,
            },
        );
    }
    spans.sort();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(bad(format!("tensors {} and {} overlap", w[0].2, w[1].2)));
        }
    }
    Ok(out)
}
