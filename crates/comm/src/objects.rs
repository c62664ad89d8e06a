//! Collectives on small serde values (index batches, seeds, metrics): the value
//! is serialised with bincode into a `u8` tensor and travels through the
//! tensor collectives, so both backends support it with no code of their own.

use super::Communicator;
use crate::{Error, Result};
use candle_core::Tensor;
use serde::de::DeserializeOwned;
use serde::Serialize;

fn encode<T: Serialize>(op: &str, v: &T) -> Result<Tensor> {
    let bytes = bincode::serialize(v)
        .map_err(|e| Error::Usage(format!("{op}: cannot serialise the value: {e}")))?;
    let n = bytes.len();
    Ok(Tensor::from_vec(bytes, n, &super::HOST)?)
}

fn decode<T: DeserializeOwned>(op: &str, t: &Tensor) -> Result<T> {
    let bytes = t.to_vec1::<u8>()?;
    bincode::deserialize(&bytes).map_err(|e| {
        Error::Usage(format!(
            "{op}: the ranks passed values of different types: {e}"
        ))
    })
}

impl Communicator {
    /// Send a value to `dst` (see [`Communicator::send`]).
    pub fn send_obj<T: Serialize>(&self, v: &T, dst: usize) -> Result<()> {
        self.send(&encode("send_obj", v)?, dst)
    }

    /// Receive a value sent with [`Communicator::send_obj`].
    pub fn recv_obj<T: DeserializeOwned>(&self, src: usize) -> Result<T> {
        decode("recv_obj", &self.recv(src)?)
    }

    /// Broadcast the root's value; other ranks pass `None`.
    pub fn bcast_obj<T: Serialize + DeserializeOwned>(
        &self,
        v: Option<&T>,
        root: usize,
    ) -> Result<T> {
        let t = match v {
            Some(v) if self.rank() == root => Some(encode("bcast_obj", v)?),
            _ => None,
        };
        decode("bcast_obj", &self.bcast(t.as_ref(), root)?)
    }

    /// Every rank's value, in rank order, on `root`; `None` elsewhere.
    pub fn gather_obj<T: Serialize + DeserializeOwned>(
        &self,
        v: &T,
        root: usize,
    ) -> Result<Option<Vec<T>>> {
        match self.gather(&encode("gather_obj", v)?, root)? {
            Some(ts) => Ok(Some(
                ts.iter()
                    .map(|t| decode("gather_obj", t))
                    .collect::<Result<_>>()?,
            )),
            None => Ok(None),
        }
    }

    /// Every rank's value, in rank order, on every rank.
    pub fn allgather_obj<T: Serialize + DeserializeOwned>(&self, v: &T) -> Result<Vec<T>> {
        let (all, counts) = self.allgather_counts(&encode("allgather_obj", v)?)?;
        let mut out = Vec::with_capacity(counts.len());
        let mut start = 0;
        for c in counts {
            out.push(decode("allgather_obj", &all.narrow(0, start, c)?)?);
            start += c;
        }
        Ok(out)
    }

    /// Combine every rank's value with `f`, folding in rank order; every rank
    /// gets the same result.
    pub fn allreduce_obj<T, F>(&self, v: &T, f: F) -> Result<T>
    where
        T: Serialize + DeserializeOwned,
        F: Fn(T, T) -> T,
    {
        let mut all = self.allgather_obj(v)?.into_iter();
        let first = all
            .next()
            .ok_or_else(|| Error::Usage("allreduce_obj: empty communicator".into()))?;
        Ok(all.fold(first, f))
    }

    /// Check that every rank has the same settings (`fields`: name, value),
    /// e.g. the parsed command line or the data's shape. One small
    /// collective of a 64-bit digest; only when the digests differ are the
    /// lists gathered, for an error (on every rank) naming each setting
    /// that differs and which ranks have which value.
    ///
    /// ```
    /// let r = shardnet_comm::launch(2, |c| {
    ///     let steps = if c.rank() == 0 { "20" } else { "10" };
    ///     c.agree("arguments", &[("--max-steps".into(), steps.into())])
    /// });
    /// let e = r.unwrap_err().to_string();
    /// assert!(e.contains("--max-steps: 20 on rank(s) [0], 10 on rank(s) [1]"), "{e}");
    /// ```
    pub fn agree(&self, what: &str, fields: &[(String, String)]) -> Result<()> {
        let digests = self.allgather_obj(&digest(fields))?;
        if digests.iter().all(|d| *d == digests[0]) {
            return Ok(());
        }
        let lists: Vec<Vec<(String, String)>> = self.allgather_obj(&fields.to_vec())?;
        let mut names: Vec<&str> = Vec::new();
        for (name, _) in lists.iter().flatten() {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
        let mut lines = Vec::new();
        for name in names {
            // (value, ranks holding it), in order of first appearance.
            let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
            for (rank, list) in lists.iter().enumerate() {
                let value = list
                    .iter()
                    .find(|(n, _)| n == name)
                    .map_or_else(|| "(not set)".to_string(), |(_, v)| v.clone());
                match groups.iter_mut().find(|(v, _)| *v == value) {
                    Some((_, ranks)) => ranks.push(rank),
                    None => groups.push((value, vec![rank])),
                }
            }
            if groups.len() > 1 {
                let parts: Vec<String> = groups
                    .iter()
                    .map(|(v, ranks)| format!("{v} on rank(s) {ranks:?}"))
                    .collect();
                lines.push(format!("  {name}: {}", parts.join(", ")));
            }
        }
        Err(Error::Usage(format!(
            "the ranks were started with different {what}:\n{}\nstart every rank with the same ones",
            lines.join("\n")
        )))
    }
}

/// FNV-1a over "name=value\n" lines: the same on every machine and process
/// (unlike std's randomly keyed hasher).
fn digest(fields: &[(String, String)]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (name, value) in fields {
        for b in name
            .bytes()
            .chain([b'='])
            .chain(value.bytes())
            .chain([b'\n'])
        {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}
