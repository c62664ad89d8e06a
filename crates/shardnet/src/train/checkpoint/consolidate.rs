//! [`consolidate`]: a checkpoint of any rank count as one single-device
//! safetensors file, one tensor in memory at a time.

use super::*;

/// What a single-device model holds of a checkpoint's tensors: its
/// parameters (`param/…`) and buffers (`buffer/…`: batch norm's running
/// statistics, without which it cannot infer), by the name a single-device
/// file gives them; not the optimizer's state.
fn model_name(name: &str) -> Option<&str> {
    name.strip_prefix("param/")
        .or_else(|| name.strip_prefix(crate::nn::BUFFER_PREFIX))
}

/// Write the parameters and buffers of the checkpoint at (or newest
/// under) `path` as one single-device safetensors file `out`, under their
/// own names (`conv1.weight`, `bn1.running_mean`), one tensor in memory at
/// a time. Returns (tensors, bytes).
pub fn consolidate(path: &Path, out: &Path) -> Result<(usize, u64)> {
    let dir = find_as("CHECKPOINT", path)?;
    let manifest = read_manifest(&dir)?;
    let params: Vec<(&String, &TensorEntry)> = manifest
        .tensors
        .iter()
        .filter(|(k, _)| model_name(k).is_some())
        .collect();
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (name, t) in &params {
        let end = t
            .shape
            .iter()
            .try_fold(4u64, |n, &d| n.checked_mul(d as u64))
            .and_then(|n| at.checked_add(n))
            .ok_or_else(|| {
                io(
                    &dir.join(MANIFEST),
                    format!("tensor {name}: {:?} is too large", t.shape),
                )
            })?;
        let plain = model_name(name).unwrap_or(name);
        if header.contains_key(plain) {
            return Err(io(
                &dir.join(MANIFEST),
                format!("{plain} is both a parameter and a buffer"),
            ));
        }
        header.insert(
            plain.to_string(),
            serde_json::json!({"dtype": "F32", "shape": t.shape, "data_offsets": [at, end]}),
        );
        at = end;
    }
    header.insert(
        "__metadata__".into(),
        serde_json::json!({
            "model": manifest.model,
            "step": manifest.step.to_string(),
            "from": dir.display().to_string(),
        }),
    );
    let h = header_bytes(header);
    let mut files = Files {
        dir: &dir,
        manifest: &manifest,
        open: BTreeMap::new(),
    };
    crate::output::write_atomic_with(out, |tmp| {
        let f = File::create(tmp).map_err(|e| Error::caused(tmp.display().to_string(), e))?;
        let mut w = std::io::BufWriter::with_capacity(8 << 20, f);
        let mut put = |b: &[u8]| {
            w.write_all(b)
                .map_err(|e| Error::caused(out.display().to_string(), e))
        };
        put(&(h.len() as u64).to_le_bytes())?;
        put(&h)?;
        for (name, t) in &params {
            // Checked against the files before its memory is taken.
            let part = plan_part(&mut files, name, &t.shape, None)?;
            let mut values = vec![0f32; part.count];
            part.read(&mut files, &mut values)?;
            put(&le_bytes(&values))?;
        }
        w.flush()
            .map_err(|e| Error::caused(out.display().to_string(), e))
    })?;
    Ok((params.len(), 8 + h.len() as u64 + at))
}
