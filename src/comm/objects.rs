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
}
