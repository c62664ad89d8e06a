//! Fuzzing the file readers on stable Rust, with proptest: corrupt,
//! truncated and foreign files are errors naming the file, never a panic;
//! valid files come back exactly.
//!
//! One section (module) per reader, each with the same parts: a generator
//! of valid files, a `parse` that maps the reader's result to
//! `Result<(), Error>`, and properties built from the shared helpers below
//! ([`refused_clearly`], [`mutated`], [`gzip`]). Its hand-made files live
//! in `tests/corpus/<reader>/`, named `ok-*` (must parse) or `err-*` (must
//! be refused), and [`corpus::every_file_has_its_expected_outcome`] runs
//! them. To add a reader: a module like [`cifar`], and a line in
//! [`corpus::CORPORA`]. The [`checkpoint`] section also damages a real
//! checkpoint directory, written once by the `shardnet` binary, and
//! consolidates it.
//!
//! Runs:
//! - `cargo test --release --test fuzz`: [`CASES`] cases a property, a few
//!   seconds in all (CI).
//! - A long fuzz: `PROPTEST_CASES=100000 cargo test --release --test fuzz`
//!   (proptest reads the variable; [`config`] then leaves it be).
//!
//! A failing case is shrunk, printed, and saved under
//! `proptest-regressions/`; commit that file, and the case runs first from
//! then on.

mod common;

use proptest::prelude::*;
use proptest::sample::Index;
use shardnet::Error;
use std::io::Write;

/// Cases per property in an ordinary run.
const CASES: u32 = 1024;

/// The name every parser is given; each error must contain it.
const NAME: &str = "fuzzed/some-file";

/// [`CASES`] cases, unless `PROPTEST_CASES` says otherwise.
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

/// `r` is Ok, or an [`Error::Io`] that names the file.
fn refused_clearly<T>(r: &Result<T, Error>, name: &str) -> Result<(), TestCaseError> {
    if let Err(e) = r {
        prop_assert!(matches!(e, Error::Io(_)), "not Error::Io: {e:?}");
        prop_assert!(e.to_string().contains(name), "{name} not named in: {e}");
    }
    Ok(())
}

/// `bytes` gzipped, as one member.
fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(bytes).expect("gzip into memory");
    gz.finish().expect("gzip into memory")
}

/// One damage done to a file.
#[derive(Clone, Debug)]
enum Mutation {
    /// Flip bit `.1` of the byte at `.0`.
    Flip(Index, u8),
    /// Keep the bytes before `.0`.
    Truncate(Index),
    /// Insert bytes before `.0`.
    Insert(Index, Vec<u8>),
    /// Overwrite bytes from `.0` on (within the file).
    Overwrite(Index, Vec<u8>),
}

impl Mutation {
    fn apply(&self, mut file: Vec<u8>) -> Vec<u8> {
        if file.is_empty() {
            if let Mutation::Insert(_, bytes) = self {
                file.extend_from_slice(bytes);
            }
            return file;
        }
        match self {
            Mutation::Flip(at, bit) => {
                let at = at.index(file.len());
                file[at] ^= 1 << bit;
            }
            Mutation::Truncate(at) => file.truncate(at.index(file.len())),
            Mutation::Insert(at, bytes) => {
                let at = at.index(file.len() + 1);
                file.splice(at..at, bytes.iter().copied());
            }
            Mutation::Overwrite(at, bytes) => {
                let at = at.index(file.len());
                let end = (at + bytes.len()).min(file.len());
                file[at..end].copy_from_slice(&bytes[..end - at]);
            }
        }
        file
    }
}

/// Files of `valid`, each damaged one to three times.
fn mutated(valid: impl Strategy<Value = Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let mutation = prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip(at, bit)),
        any::<Index>().prop_map(Mutation::Truncate),
        (any::<Index>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, b)| Mutation::Insert(at, b)),
        (any::<Index>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(at, b)| Mutation::Overwrite(at, b)),
    ];
    (valid, prop::collection::vec(mutation, 1..4))
        .prop_map(|(file, ms)| ms.iter().fold(file, |f, m| m.apply(f)))
}

/// Any bytes, short or up to 2 KB.
fn any_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..2048)
}

/// The idx reader (MNIST): `parse_idx` and `mnist_from_idx`.
mod idx {
    use super::*;
    use shardnet::data::{mnist_from_idx, parse_idx};

    /// An idx file of unsigned bytes.
    pub fn file(dims: &[u32], data: &[u8]) -> Vec<u8> {
        let mut f = vec![0, 0, 8, dims.len() as u8];
        f.extend(dims.iter().flat_map(|d| d.to_be_bytes()));
        f.extend_from_slice(data);
        f
    }

    /// Valid small idx files: (dimensions, data).
    fn valid() -> impl Strategy<Value = (Vec<u32>, Vec<u8>)> {
        prop::collection::vec(0u32..6, 1..=4).prop_flat_map(|dims| {
            let n = dims.iter().product::<u32>() as usize;
            (Just(dims), prop::collection::vec(any::<u8>(), n))
        })
    }

    /// Parse, and check the outcome is sound: an error names the file; a
    /// success has as many data bytes as its dimensions say.
    pub fn parse(bytes: &[u8], name: &str) -> Result<(), Error> {
        let r = parse_idx(bytes, name);
        if let Ok((dims, data)) = &r {
            let n = dims.iter().try_fold(1usize, |n, d| n.checked_mul(*d));
            assert_eq!(n, Some(data.len()), "{dims:?}");
        }
        r.map(drop)
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn any_bytes_are_refused_clearly(bytes in any_bytes()) {
            refused_clearly(&parse(&bytes, NAME), NAME)?;
        }

        #[test]
        fn any_bytes_after_an_idx_magic_are_refused_clearly(
            ndim in any::<u8>(), rest in any_bytes()
        ) {
            let mut bytes = vec![0, 0, 8, ndim];
            bytes.extend(rest);
            refused_clearly(&parse(&bytes, NAME), NAME)?;
            refused_clearly(&parse(&gzip(&bytes), NAME), NAME)?;
        }

        #[test]
        fn valid_files_round_trip((dims, data) in valid(), split in any::<Index>()) {
            let f = file(&dims, &data);
            let want = (dims.iter().map(|d| *d as usize).collect::<Vec<_>>(), data);
            prop_assert_eq!(parse_idx(&f, NAME).unwrap(), want.clone());
            prop_assert_eq!(parse_idx(&gzip(&f), NAME).unwrap(), want.clone());
            // Two gzip members, as `cat a.gz b.gz`, are one file.
            let at = split.index(f.len() + 1);
            let two = [gzip(&f[..at]), gzip(&f[at..])].concat();
            prop_assert_eq!(parse_idx(&two, NAME).unwrap(), want);
        }

        #[test]
        fn damaged_files_are_refused_clearly(
            f in mutated(valid().prop_map(|(d, x)| file(&d, &x)))
        ) {
            refused_clearly(&parse(&f, NAME), NAME)?;
            refused_clearly(&parse(&gzip(&f), NAME), NAME)?;
        }

        #[test]
        fn damaged_gzip_is_refused_clearly(
            f in mutated(valid().prop_map(|(d, x)| gzip(&file(&d, &x))))
        ) {
            refused_clearly(&parse(&f, NAME), NAME)?;
        }

        #[test]
        fn wrong_dimensions_are_refused_unless_they_fit_the_data(
            (_, data) in valid(),
            dims in prop::collection::vec(prop_oneof![0u32..8, any::<u32>()], 1..=5),
        ) {
            let f = file(&dims, &data);
            let fits = dims.iter().try_fold(1usize, |n, d| n.checked_mul(*d as usize))
                == Some(data.len());
            for f in [f.clone(), gzip(&f)] {
                let r = parse(&f, NAME);
                refused_clearly(&r, NAME)?;
                prop_assert_eq!(r.is_ok(), fits, "dims {:?}, {} bytes", dims, data.len());
            }
        }

        #[test]
        fn mnist_sets_pair_images_and_labels_or_say_which_file(
            n in 0u32..3,
            side in prop_oneof![Just(28u32), 0u32..30],
            extra in prop_oneof![Just(None), (0u32..4).prop_map(Some)],
            m in prop_oneof![Just(None), (0u32..4).prop_map(Some)],
            pixels in prop::collection::vec(any::<u8>(), 2 * 28 * 29 * 3),
            labels in prop::collection::vec(prop_oneof![0u8..10, any::<u8>()], 4),
        ) {
            // Images n × 28 × side (× extra); labels m (n unless given).
            let mut idims = vec![n, 28, side];
            idims.extend(extra);
            let m = m.unwrap_or(n);
            let np = idims.iter().product::<u32>() as usize;
            let images = file(&idims, &pixels[..np]);
            let labels_file = file(&[m], &labels[..m as usize]);
            let r = mnist_from_idx(&images, "the-images", &labels_file, "the-labels");
            let ok = side == 28 && extra.is_none() && m == n && n > 0
                && labels[..n as usize].iter().all(|l| *l < 10);
            prop_assert_eq!(r.is_ok(), ok, "{:?} {}: {:?}", idims, m, r.as_ref().err());
            match r {
                Ok(ds) => {
                    let x = ds.x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    let want: Vec<f32> =
                        pixels[..np].iter().map(|b| f32::from(*b) / 255.0).collect();
                    prop_assert_eq!(ds.x.dims(), &[n as usize, 784]);
                    for (a, b) in x.iter().zip(&want) {
                        prop_assert!((a - b).abs() < 1e-6);
                    }
                    let t = ds.t.to_vec1::<u32>().unwrap();
                    let want: Vec<u32> = labels[..n as usize].iter().map(|l| u32::from(*l)).collect();
                    prop_assert_eq!(t, want);
                }
                Err(e) => {
                    let e = e.to_string();
                    prop_assert!(e.contains("the-images") || e.contains("the-labels"), "{}", e);
                }
            }
        }
    }

    #[test]
    fn every_truncation_is_refused() {
        let f = file(&[2, 3, 4], &(0..24).collect::<Vec<u8>>());
        for cut in 0..f.len() {
            let e = parse(&f[..cut], NAME).expect_err("a truncated file");
            assert!(e.to_string().contains(NAME), "{e}");
        }
        let gz = gzip(&f);
        for cut in 0..gz.len() {
            let e = parse(&gz[..cut], NAME).expect_err("a truncated gzip file");
            assert!(e.to_string().contains(NAME), "{e}");
        }
    }

    #[test]
    fn dimensions_that_overflow_are_refused() {
        for dims in [
            vec![u32::MAX; 4],
            vec![65536; 4],              // 2^64: wraps to 0 in usize
            vec![65536, 65536, 65536],   // 2^48
            vec![65536, 65536, 2],       // 8 GiB
            vec![0, u32::MAX, u32::MAX], // 0 bytes, yet no MNIST set
        ] {
            let r = parse(&file(&dims, &[]), NAME);
            if dims[0] == 0 {
                assert!(r.is_ok(), "{dims:?}: {r:?}");
                continue;
            }
            let e = r.expect_err("too much data declared").to_string();
            assert!(e.contains(NAME) && e.contains("4 GiB"), "{e}");
        }
        let images = file(&[0, u32::MAX, u32::MAX], &[]);
        let labels = file(&[0], &[]);
        let e = mnist_from_idx(&images, "imgs", &labels, "lbls").expect_err("not 28×28");
        assert!(e.to_string().contains("imgs"), "{e}");
    }

    #[test]
    fn a_gzip_bomb_is_refused_by_its_header() {
        // 64 MiB of zeros behind a header that declares one byte: refused
        // after inflating two bytes of data; the CRC is never reached.
        let mut f = file(&[1], &[0]);
        f.resize(64 << 20, 0);
        let bomb = gzip(&f);
        assert!(bomb.len() < 100_000, "{}", bomb.len());
        // "has more", not "has 67108856": the reader stopped.
        let e = parse(&bomb, NAME).expect_err("a bomb").to_string();
        assert!(
            e.contains("need 1 bytes of data") && e.contains("has more"),
            "{e}"
        );
    }
}

/// The CIFAR-10 reader: `parse_cifar_batch`.
mod cifar {
    use super::*;
    use shardnet::data::parse_cifar_batch;

    /// Bytes of one record.
    const RECORD: usize = 3073;

    /// Valid batch files of 1 to 3 records: (labels, pixels, the file).
    fn valid() -> impl Strategy<Value = (Vec<u8>, Vec<u8>, Vec<u8>)> {
        (1usize..4).prop_flat_map(|n| {
            (
                prop::collection::vec(0u8..10, n),
                prop::collection::vec(any::<u8>(), n * (RECORD - 1)),
            )
                .prop_map(|(labels, pixels)| {
                    let file = labels
                        .iter()
                        .zip(pixels.chunks_exact(RECORD - 1))
                        .flat_map(|(l, p)| std::iter::once(*l).chain(p.iter().copied()))
                        .collect();
                    (labels, pixels, file)
                })
        })
    }

    /// Parse, and check a success is sound: a label per record, each below
    /// 10, and 3072 pixels per record.
    pub fn parse(bytes: &[u8], name: &str) -> Result<(), Error> {
        let r = parse_cifar_batch(bytes, name);
        if let Ok((labels, pixels)) = &r {
            assert_eq!(labels.len() * RECORD, bytes.len());
            assert_eq!(pixels.len(), labels.len() * (RECORD - 1));
            assert!(labels.iter().all(|l| *l < 10), "{labels:?}");
        }
        r.map(drop)
    }

    /// Whether `bytes` is a valid batch file, by the format's definition.
    fn is_valid(bytes: &[u8]) -> bool {
        !bytes.is_empty()
            && bytes.len().is_multiple_of(RECORD)
            && bytes.chunks_exact(RECORD).all(|r| r[0] < 10)
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn any_bytes_are_refused_clearly(bytes in any_bytes()) {
            refused_clearly(&parse(&bytes, NAME), NAME)?;
        }

        #[test]
        fn valid_files_round_trip((labels, pixels, file) in valid()) {
            prop_assert_eq!(parse_cifar_batch(&file, NAME).unwrap(), (labels, pixels));
        }

        #[test]
        fn damaged_files_parse_exactly_when_still_valid(
            f in mutated(valid().prop_map(|(_, _, f)| f))
        ) {
            let r = parse(&f, NAME);
            refused_clearly(&r, NAME)?;
            prop_assert_eq!(r.is_ok(), is_valid(&f));
        }

        #[test]
        fn gzipped_files_are_refused_clearly((_, _, f) in valid()) {
            let e = parse(&gzip(&f), NAME).expect_err("gzip");
            prop_assert!(e.to_string().contains("gzip") && e.to_string().contains(NAME));
        }
    }

    #[test]
    fn every_truncation_is_refused_unless_whole_records() {
        let f: Vec<u8> = (0..2 * RECORD).map(|i| (i % 7) as u8).collect();
        for cut in 0..f.len() {
            let r = parse(&f[..cut], NAME);
            assert_eq!(r.is_ok(), cut == RECORD, "cut at {cut}: {r:?}");
            if let Err(e) = r {
                assert!(e.to_string().contains(NAME), "{e}");
            }
        }
    }
}

/// The checkpoint reader: `parse_safetensors_header` (a rank's file),
/// `parse_manifest` (`manifest.json`), and `consolidate` over a whole
/// checkpoint directory that the `shardnet` binary wrote.
mod checkpoint {
    use super::*;
    use serde_json::{json, Value};
    use shardnet::train::checkpoint::{
        consolidate, parse_manifest, parse_safetensors_header, seal_manifest, FileTensor, FORMAT,
        MANIFEST,
    };
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};
    use std::sync::OnceLock;

    /// Tensors as (name, shape), in file order.
    type Tensors = Vec<(String, Vec<usize>)>;

    /// `header` as a safetensors header, padded with spaces so that the
    /// data start 8-aligned as shardnet writes it, then `data` bytes.
    fn with_header(header: &Value, data: &[u8]) -> Vec<u8> {
        let mut h = header.to_string().into_bytes();
        while !(8 + h.len()).is_multiple_of(8) {
            h.push(b' ');
        }
        let mut f = (h.len() as u64).to_le_bytes().to_vec();
        f.extend(h);
        f.extend_from_slice(data);
        f
    }

    /// The JSON header of a file of `tensors` laid out one after another.
    fn header_of(tensors: &[(String, Vec<usize>)]) -> (Value, usize) {
        let mut header = serde_json::Map::new();
        let mut at = 0;
        for (name, shape) in tensors {
            let n = 4 * shape.iter().product::<usize>();
            header.insert(
                name.clone(),
                json!({"dtype": "F32", "shape": shape, "data_offsets": [at, at + n]}),
            );
            at += n;
        }
        header.insert(
            "__metadata__".into(),
            json!({"format": FORMAT, "rank": "0", "ranks": "1", "step": "1", "shards": "{}"}),
        );
        (Value::Object(header), at)
    }

    /// A safetensors file of `tensors` as shardnet writes one.
    pub fn safetensors(tensors: &[(String, Vec<usize>)]) -> Vec<u8> {
        let (header, n) = header_of(tensors);
        let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
        with_header(&header, &data)
    }

    /// Valid small files: (tensors, the file).
    fn valid() -> impl Strategy<Value = (Tensors, Vec<u8>)> {
        prop::collection::vec(prop::collection::vec(0usize..5, 0..=3), 0..4).prop_map(|shapes| {
            let t: Tensors = shapes
                .into_iter()
                .enumerate()
                .map(|(i, s)| (format!("param/t{i}"), s))
                .collect();
            let f = safetensors(&t);
            (t, f)
        })
    }

    /// `parse_safetensors_header` of a whole file, checking a success is
    /// sound: every tensor's bytes lie after the header and inside the
    /// file, and no two tensors with values share bytes.
    fn header(bytes: &[u8], name: &str) -> Result<BTreeMap<String, FileTensor>, Error> {
        let r = parse_safetensors_header(bytes, bytes.len() as u64, name);
        if let Ok(t) = &r {
            let data = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap());
            let mut spans = Vec::new();
            for (k, t) in t {
                let n = t
                    .shape
                    .iter()
                    .try_fold(4u64, |n, &d| n.checked_mul(d as u64))
                    .unwrap_or_else(|| panic!("{k}: {:?} accepted", t.shape));
                assert!(t.start >= data, "{k} starts in the header");
                assert!(t.start + n <= bytes.len() as u64, "{k} ends past the file");
                if n > 0 {
                    spans.push((t.start, t.start + n));
                }
            }
            spans.sort();
            assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "{spans:?}");
        }
        r
    }

    /// A valid manifest of `ranks` ranks: each tensor (shape, split
    /// dimension, pieces, split or not) whole in one file or split along
    /// its dimension into consecutive pieces, one a file.
    fn manifest_json(ranks: usize, tensors: &[(Vec<usize>, usize, usize, bool)]) -> Value {
        let mut map = serde_json::Map::new();
        for (i, (shape, dim, parts, split)) in tensors.iter().enumerate() {
            let pieces: Vec<Value> = if *split {
                let dim = *dim;
                let (n, k) = (shape[dim], (*parts).min(ranks));
                let mut at = 0;
                (0..k)
                    .map(|r| {
                        let len = n / k + usize::from(r < n % k);
                        let mut s = shape.clone();
                        s[dim] = len;
                        let p = json!({"file": r, "shape": s,
                            "shard": {"dim": dim, "offset": at, "global": n}});
                        at += len;
                        p
                    })
                    .collect()
            } else {
                vec![json!({"file": i % ranks, "shape": shape, "shard": null})]
            };
            map.insert(
                format!("param/t{i}"),
                json!({"shape": shape, "pieces": pieces}),
            );
        }
        let files: Vec<Value> = (0..ranks)
            .map(|r| {
                json!({"name": format!("rank-{r:05}-of-{ranks:05}.safetensors"),
                    "bytes": 4096, "sha256": "00", "blocks": ["00"]})
            })
            .collect();
        json!({
            "format": FORMAT, "run": "0123456789abcdef", "model": "mnist-mlp",
            "settings": [["--units", "4"]],
            "ranks": ranks, "step": 3, "progress": {"epoch": 0},
            "scalars": vec![json!({"step": 3}); ranks], "files": files,
            "tensors": Value::Object(map),
        })
    }

    /// Valid manifests, as JSON.
    fn valid_manifest() -> impl Strategy<Value = Value> {
        let tensor = (
            prop::collection::vec(0usize..6, 1..=3),
            any::<Index>(),
            1usize..4,
            any::<bool>(),
        );
        (1usize..4, prop::collection::vec(tensor, 0..4)).prop_map(|(ranks, t)| {
            let t: Vec<_> = t
                .into_iter()
                .map(|(s, d, k, split)| {
                    let d = d.index(s.len());
                    (s, d, k, split)
                })
                .collect();
            manifest_json(ranks, &t)
        })
    }

    /// `parse_manifest` of `bytes` with their own SHA-256 added (as a
    /// writer that made them would), checking a success is sound: every
    /// piece lies in a file of the checkpoint and inside its tensor, and no
    /// two pieces with values share one.
    fn manifest(bytes: &[u8], name: &str) -> Result<(), Error> {
        let r = parse_manifest(&seal_manifest(bytes), Path::new(name));
        if let Ok(m) = &r {
            assert!(m.ranks > 0 && m.files.len() == m.ranks && m.scalars.len() == m.ranks);
            for (k, t) in &m.tensors {
                let boxes: Vec<Vec<(usize, usize)>> = t
                    .pieces
                    .iter()
                    .map(|p| {
                        assert!(p.file < m.ranks && p.shape.len() == t.shape.len(), "{k}");
                        let b: Vec<(usize, usize)> = (0..t.shape.len())
                            .map(|d| match p.shard {
                                Some(s) if s.dim == d => (s.offset, s.offset + p.shape[d]),
                                Some(_) => (0, p.shape[d]),
                                None => (0, p.shape[d]),
                            })
                            .collect();
                        assert!(b.iter().zip(&t.shape).all(|((_, e), n)| e <= n), "{k}");
                        assert!(p.shard.is_none_or(|s| s.dim < t.shape.len()), "{k}");
                        b
                    })
                    .filter(|b| b.iter().all(|(a, e)| a < e))
                    .collect();
                for (i, a) in boxes.iter().enumerate() {
                    for b in &boxes[..i] {
                        let apart = a.iter().zip(b).any(|(x, y)| x.1 <= y.0 || y.1 <= x.0);
                        assert!(apart, "{k}: pieces {a:?} and {b:?} overlap");
                    }
                }
            }
        }
        r.map(drop)
    }

    /// Parse a corpus file: `.json` as a manifest, anything else as a
    /// safetensors file.
    pub fn parse(bytes: &[u8], name: &str) -> Result<(), Error> {
        if name.ends_with(".json") {
            manifest(bytes, name)
        } else {
            header(bytes, name).map(drop)
        }
    }

    /// One edit of a JSON document, at the place `.0` picks (the document
    /// itself, an entry, an element, at any depth).
    #[derive(Clone, Debug)]
    enum Edit {
        Set(Index, Value),
        Nudge(Index, i64),
        Remove(Index),
    }

    /// Every place in `v` as a JSON pointer, `v` itself first.
    fn places(v: &Value, at: String, out: &mut Vec<String>) {
        out.push(at.clone());
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    places(
                        x,
                        format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                        out,
                    );
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    places(x, format!("{at}/{i}"), out);
                }
            }
            _ => {}
        }
    }

    impl Edit {
        fn apply(&self, mut v: Value) -> Value {
            let mut all = Vec::new();
            places(&v, String::new(), &mut all);
            let (Edit::Set(at, _) | Edit::Nudge(at, _) | Edit::Remove(at)) = self;
            let place = all[at.index(all.len())].clone();
            match self {
                Edit::Set(_, x) => {
                    if let Some(t) = v.pointer_mut(&place) {
                        *t = x.clone();
                    }
                }
                Edit::Nudge(_, by) => {
                    if let Some(t) = v.pointer_mut(&place) {
                        if let Some(n) = t.as_u64() {
                            *t = n.checked_add_signed(*by).map_or(json!(-1), Value::from);
                        }
                    }
                }
                Edit::Remove(_) => {
                    if let Some((parent, key)) = place.rsplit_once('/') {
                        let key = key.replace("~1", "/").replace("~0", "~");
                        match v.pointer_mut(parent) {
                            Some(Value::Object(m)) => {
                                m.remove(&key);
                            }
                            Some(Value::Array(a)) => {
                                if let Ok(i) = key.parse::<usize>() {
                                    a.remove(i);
                                }
                            }
                            _ => {}
                        }
                    }
                }
            }
            v
        }
    }

    /// Values that make a field wrong: numbers at the edges, negative or
    /// fractional ones, other types, shapes of other ranks, huge dims.
    fn odd_value() -> impl Strategy<Value = Value> {
        let edge = prop_oneof![
            Just(0u64),
            Just(1),
            Just(2),
            Just(7),
            Just(1 << 32),
            Just(1 << 62),
            Just(u64::MAX),
            any::<u64>(),
        ];
        prop_oneof![
            edge.prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            prop_oneof![
                Just(json!(-1)),
                Just(json!(1.5)),
                Just(json!(2.0)),
                Just(json!(1e300)),
                Just(json!("F16")),
                Just(json!(null)),
                Just(json!({})),
                Just(json!(true)),
            ],
            prop::collection::vec(prop_oneof![0u64..6, Just(1u64 << 32), Just(u64::MAX)], 0..5)
                .prop_map(|v| json!(v)),
            Just(json!({"dim": 0, "offset": 0, "global": 1})),
        ]
    }

    /// One to three edits.
    fn edits() -> impl Strategy<Value = Vec<Edit>> {
        let edit = prop_oneof![
            3 => (any::<Index>(), odd_value()).prop_map(|(at, v)| Edit::Set(at, v)),
            3 => (any::<Index>(), prop_oneof![-2i64..=2, Just(1 << 32)])
                .prop_map(|(at, by)| Edit::Nudge(at, by)),
            1 => any::<Index>().prop_map(Edit::Remove),
        ];
        prop::collection::vec(edit, 1..4)
    }

    fn apply(v: Value, edits: &[Edit]) -> Value {
        edits.iter().fold(v, |v, e| e.apply(v))
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn any_bytes_are_refused_clearly(bytes in any_bytes()) {
            refused_clearly(&header(&bytes, NAME), NAME)?;
            refused_clearly(&manifest(&bytes, NAME), NAME)?;
        }

        #[test]
        fn any_header_text_is_refused_clearly(text in any_bytes(), data in any_bytes()) {
            let mut f = (text.len() as u64).to_le_bytes().to_vec();
            f.extend(text);
            f.extend(data);
            refused_clearly(&header(&f, NAME), NAME)?;
        }

        #[test]
        fn valid_files_round_trip((tensors, f) in valid()) {
            let got = header(&f, NAME).unwrap();
            let data = 8 + u64::from_le_bytes(f[..8].try_into().unwrap());
            let mut at = data;
            let mut want = BTreeMap::new();
            for (name, shape) in &tensors {
                want.insert(name.clone(), FileTensor { shape: shape.clone(), start: at });
                at += 4 * shape.iter().product::<usize>() as u64;
            }
            prop_assert_eq!(at, f.len() as u64);
            prop_assert_eq!(got, want);
        }

        #[test]
        fn damaged_files_are_refused_clearly(f in mutated(valid().prop_map(|(_, f)| f))) {
            refused_clearly(&header(&f, NAME), NAME)?;
        }

        #[test]
        fn edited_headers_are_refused_clearly((tensors, _) in valid(), e in edits()) {
            let (h, n) = header_of(&tensors);
            let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
            let f = with_header(&apply(h, &e), &data);
            refused_clearly(&header(&f, NAME), NAME)?;
        }

        #[test]
        fn header_lengths_and_file_lengths_that_lie_are_refused_clearly(
            (_, f) in valid(),
            n in prop_oneof![
                Just(u64::MAX), Just(u64::MAX - 7), Just((256 << 20) + 1), any::<u64>(), 0u64..64
            ],
            file_len in prop_oneof![Just(u64::MAX), any::<u64>(), 0u64..4096],
        ) {
            let mut g = f.clone();
            g[..8].copy_from_slice(&n.to_le_bytes());
            refused_clearly(&header(&g, NAME), NAME)?;
            refused_clearly(&parse_safetensors_header(&f, file_len, NAME), NAME)?;
            refused_clearly(&parse_safetensors_header(&g, file_len, NAME), NAME)?;
            // A file shorter than its header says.
            if file_len < f.len() as u64 && f.len() > 8 {
                let min = 8 + u64::from_le_bytes(f[..8].try_into().unwrap());
                let r = parse_safetensors_header(&f, file_len, NAME);
                prop_assert!(r.is_err() || file_len >= min, "{:?}", r);
            }
        }

        #[test]
        fn valid_manifests_round_trip(v in valid_manifest()) {
            let bytes = seal_manifest(&serde_json::to_vec_pretty(&v).unwrap());
            manifest(&bytes, NAME).unwrap();
            let m = parse_manifest(&bytes, Path::new(NAME)).unwrap();
            prop_assert_eq!(serde_json::to_value(&m.tensors).unwrap(), v["tensors"].clone());
            prop_assert_eq!(serde_json::to_value(&m.files).unwrap(), v["files"].clone());
        }

        #[test]
        fn damaged_manifests_are_refused_clearly(
            f in mutated(valid_manifest().prop_map(|v| serde_json::to_vec_pretty(&v).unwrap()))
        ) {
            refused_clearly(&manifest(&f, NAME), NAME)?;
        }

        #[test]
        fn edited_manifests_are_refused_clearly(v in valid_manifest(), e in edits()) {
            let f = serde_json::to_vec(&apply(v, &e)).unwrap();
            refused_clearly(&manifest(&f, NAME), NAME)?;
        }

        /// Any change to a manifest's bytes after its SHA-256 was taken is
        /// refused, whatever it does to the content.
        #[test]
        fn a_manifest_changed_after_its_checksum_is_refused(
            v in valid_manifest(),
            at in any::<Index>(),
            by in 1u8..=255,
        ) {
            let mut f = seal_manifest(&serde_json::to_vec_pretty(&v).unwrap());
            let i = at.index(f.len());
            f[i] = f[i].wrapping_add(by);
            let r = parse_manifest(&f, Path::new(NAME));
            prop_assert!(r.is_err(), "byte {} changed, accepted", i);
            refused_clearly(&r.map(drop), NAME)?;
        }
    }

    #[test]
    fn every_truncation_is_refused() {
        let t: Tensors = vec![("a".into(), vec![2, 3]), ("b".into(), vec![1])];
        let f = safetensors(&t);
        for cut in 0..f.len() {
            let e = header(&f[..cut], NAME).expect_err("a truncated file");
            assert!(e.to_string().contains(NAME), "{e}");
        }
    }

    /// A one-tensor file with header entry `entry` and `data` bytes.
    fn one(entry: Value, data: usize) -> Vec<u8> {
        with_header(&json!({ "t": entry }), &vec![0; data])
    }

    #[test]
    fn shapes_and_offsets_that_lie_are_refused() {
        let entry = |shape: Value, offsets: Value| json!({"dtype": "F32", "shape": shape, "data_offsets": offsets});
        for (shape, offsets) in [
            // 4·2^64 bytes: 0 in wrapping arithmetic.
            (json!([1u64 << 32, 1u64 << 32]), json!([0, 0])),
            (json!([1u64 << 62, 4]), json!([0, 0])),
            (json!([u64::MAX, 2]), json!([0, 16])),
            (json!([u64::MAX]), json!([0, u64::MAX])),
            (json!([-1]), json!([0, 4])),
            (json!([1.0]), json!([0, 4])),
            (json!(["1"]), json!([0, 4])),
            (json!(2), json!([0, 8])),
            (json!([2]), json!([0, 16])),
            (json!([2]), json!([8, 0])),
            (json!([2]), json!([u64::MAX - 7, u64::MAX])),
            (json!([2]), json!([8, 16])), // past the file's 8 bytes of data
            (json!([2]), json!([0])),
            (json!([2]), json!([0, 8, 16])),
            (json!([2]), json!([-8, 0])),
        ] {
            let f = one(entry(shape.clone(), offsets.clone()), 8);
            let e = header(&f, NAME).expect_err("a lie").to_string();
            assert!(e.contains(NAME), "{shape} {offsets}: {e}");
        }
        for dtype in [json!("F16"), json!("f32"), json!(null), json!(32)] {
            let f = one(
                json!({"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}),
                8,
            );
            let e = header(&f, NAME).expect_err("not F32").to_string();
            assert!(e.contains(NAME) && e.contains("F32"), "{e}");
        }
        // Overlapping tensors; touching ones are fine.
        let two = |b: [u64; 2]| {
            let h = json!({
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": b},
            });
            let f = with_header(&h, &[0; 16]);
            parse_safetensors_header(&f, f.len() as u64, NAME)
        };
        assert!(two([8, 16]).is_ok());
        let e = two([4, 12]).expect_err("overlap").to_string();
        assert!(e.contains(NAME) && e.contains("overlap"), "{e}");
        // Header lengths beyond the file or u64.
        let f = safetensors(&[("a".into(), vec![2])]);
        for n in [u64::MAX, u64::MAX - 7, f.len() as u64 - 7, 1 << 40] {
            let mut g = f.clone();
            g[..8].copy_from_slice(&n.to_le_bytes());
            let e = header(&g, NAME).expect_err("a lying length").to_string();
            assert!(e.contains(NAME), "{e}");
        }
    }

    #[test]
    fn manifests_that_misplace_pieces_are_refused() {
        let base = manifest_json(2, &[(vec![4, 3], 0, 2, true)]);
        let piece = "/tensors/param~1t0/pieces";
        let cases: Vec<(&str, Value)> = vec![
            ("/0/shard/offset", json!(3)),          // past the global size
            ("/1/shard/offset", json!(usize::MAX)), // offset + size overflows
            ("/0/shard/dim", json!(2)),             // no such dimension
            ("/0/shard/global", json!(5)),          // not the tensor's size
            ("/1/file", json!(2)),                  // no such file
            ("/0/shape", json!([2])),               // a shape of another rank
            ("/0/shape", json!([2, 3, 1])),
            ("/0/shape", json!([2, 2])),   // not the tensor's other dims
            ("/1/shard/offset", json!(1)), // overlaps piece 0
            ("/1/shard", json!(null)),     // whole, over piece 0
            ("/0/shard/offset", json!(-1)),
            ("/0/shard/offset", json!(0.5)),
        ];
        for (at, value) in cases {
            let mut v = base.clone();
            *v.pointer_mut(&format!("{piece}{at}")).unwrap() = value.clone();
            let f = serde_json::to_vec(&v).unwrap();
            let e = manifest(&f, NAME).expect_err(at).to_string();
            assert!(e.contains(NAME), "{at} = {value}: {e}");
        }
        for (at, value) in [
            ("/ranks", json!(0)),
            ("/ranks", json!(3)),
            ("/format", json!("shardnet-checkpoint/3")),
            ("/files/0/name", json!("../rank-00000-of-00002.safetensors")),
            ("/files/0/name", json!("/etc/passwd")),
            ("/files/0/name", json!("..")),
        ] {
            let mut v = base.clone();
            *v.pointer_mut(at).unwrap() = value.clone();
            let e = manifest(&serde_json::to_vec(&v).unwrap(), NAME).expect_err(at);
            assert!(e.to_string().contains(NAME), "{at} = {value}: {e}");
        }
        let mut v = base.clone();
        v["ranks"] = json!(0);
        v["files"] = json!([]);
        v["scalars"] = json!([]);
        let e = manifest(&serde_json::to_vec(&v).unwrap(), NAME).expect_err("no ranks");
        assert!(e.to_string().contains(NAME), "{e}");
        // Pieces without values overlap nothing (more ranks than rows).
        let v = manifest_json(3, &[(vec![2, 3], 0, 3, true)]);
        manifest(&serde_json::to_vec(&v).unwrap(), NAME).unwrap();
    }

    /// A directory's files: (name, bytes).
    type Files = Vec<(String, Vec<u8>)>;

    /// A tiny tensor-parallel checkpoint (two ranks, pieces split along
    /// both dimensions) written once by the `shardnet` binary: its files.
    fn real() -> &'static Files {
        static REAL: OnceLock<Files> = OnceLock::new();
        REAL.get_or_init(|| {
            let root = scratch("written");
            let ck = root.join("ck");
            let (out, text) = crate::common::shardnet(&[
                "train",
                "mnist-mlp",
                "--parallel",
                "tensor",
                "--units",
                "4",
                "--ranks",
                "2",
                "--batch-size",
                "100",
                "--max-steps",
                "1",
                "--no-eval",
                "--checkpoint-dir",
                ck.to_str().unwrap(),
            ]);
            assert!(out.status.success(), "{text}");
            let dir = ck.join("step-000000001");
            let mut files: Files = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| {
                    let e = e.unwrap();
                    (
                        e.file_name().into_string().unwrap(),
                        std::fs::read(e.path()).unwrap(),
                    )
                })
                .collect();
            files.sort();
            let _ = std::fs::remove_dir_all(&root);
            files
        })
    }

    /// A fresh scratch directory, unique in this process.
    fn scratch(what: &str) -> PathBuf {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d =
            std::env::temp_dir().join(format!("shardnet-fuzz-{}-{what}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// The real checkpoint consolidated, as written.
    fn real_consolidated() -> &'static Vec<u8> {
        static OUT: OnceLock<Vec<u8>> = OnceLock::new();
        OUT.get_or_init(|| {
            let dir = scratch("baseline");
            for (n, b) in real() {
                std::fs::write(dir.join(n), b).unwrap();
            }
            let out = dir.join("model.safetensors");
            consolidate(&dir, &out).unwrap();
            let bytes = std::fs::read(&out).unwrap();
            let _ = std::fs::remove_dir_all(&dir);
            bytes
        })
    }

    /// A safetensors file's tensors: name, shape and value bytes.
    fn values(f: &[u8]) -> BTreeMap<String, (Vec<usize>, Vec<u8>)> {
        header(f, "consolidated")
            .unwrap()
            .into_iter()
            .map(|(k, t)| {
                let n = 4 * t.shape.iter().product::<usize>();
                let at = t.start as usize;
                (k, (t.shape, f[at..at + n].to_vec()))
            })
            .collect()
    }

    /// Consolidate a copy of the real checkpoint with file `name` replaced
    /// by `bytes`; a success must give what the real checkpoint gives, byte
    /// for byte: never a parameter with other values, or in another place.
    fn consolidate_with(name: &str, bytes: &[u8]) -> (PathBuf, Result<(), Error>) {
        let dir = scratch("ck");
        for (n, b) in real() {
            std::fs::write(dir.join(n), if n == name { bytes } else { b }).unwrap();
        }
        let out = dir.join("model.safetensors");
        let r = consolidate(&dir, &out).map(|(n, _)| {
            let f = std::fs::read(&out).unwrap();
            let got = header(&f, "consolidated").unwrap();
            let m = shardnet::train::checkpoint::read_manifest(&dir).unwrap();
            let want: BTreeMap<String, Vec<usize>> = m
                .tensors
                .iter()
                .filter_map(|(k, t)| Some((k.strip_prefix("param/")?.to_string(), t.shape.clone())))
                .collect();
            let got: BTreeMap<String, Vec<usize>> =
                got.into_iter().map(|(k, t)| (k, t.shape)).collect();
            assert_eq!(got, want);
            assert_eq!(n, want.len());
            assert!(
                values(&f) == values(real_consolidated()),
                "consolidated, but not to the real values"
            );
        });
        (dir, r)
    }

    /// The real checkpoint's rank file `rank` (name, bytes).
    fn rank_file(rank: usize) -> (String, Vec<u8>) {
        let name = format!("rank-{rank:05}-of-00002.safetensors");
        let f = real().iter().find(|(n, _)| *n == name).unwrap();
        f.clone()
    }

    fn cleanup(dir: &Path) {
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_real_checkpoint_consolidates_and_its_files_parse() {
        let (dir, r) = consolidate_with("", &[]);
        r.unwrap();
        cleanup(&dir);
        for (name, bytes) in real() {
            parse(bytes, name).unwrap();
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: config().cases / 8, ..config() })]

        #[test]
        fn a_damaged_rank_file_is_named(
            (rank, bytes) in (0usize..2).prop_flat_map(|r| (Just(r), mutated(Just(rank_file(r).1))))
        ) {
            let (name, orig) = rank_file(rank);
            let (dir, r) = consolidate_with(&name, &bytes);
            match r {
                Ok(()) => prop_assert_eq!(bytes, orig),
                Err(e) => {
                    let path = dir.join(&name);
                    prop_assert!(matches!(e, Error::Io(_)), "{:?}", e);
                    prop_assert!(e.to_string().contains(&path.display().to_string()), "{}", e);
                }
            }
            cleanup(&dir);
        }

        #[test]
        fn a_rank_file_with_another_header_is_named(rank in 0usize..2, e in edits()) {
            let (name, orig) = rank_file(rank);
            let n = 8 + u64::from_le_bytes(orig[..8].try_into().unwrap()) as usize;
            let h: Value = serde_json::from_slice(&orig[8..n]).unwrap();
            let bytes = with_header(&apply(h, &e), &orig[n..]);
            let (dir, r) = consolidate_with(&name, &bytes);
            match r {
                Ok(()) => prop_assert_eq!(bytes, orig),
                Err(e) => {
                    let path = dir.join(&name);
                    prop_assert!(e.to_string().contains(&path.display().to_string()), "{}", e);
                }
            }
            cleanup(&dir);
        }

        /// Edits to a manifest, its SHA-256 then made to match (as a
        /// writer with a bug would): refused naming the checkpoint, or
        /// loaded to exactly the real values, never silently wrong.
        #[test]
        fn an_edited_manifest_is_refused_or_loads_the_real_values(e in edits()) {
            let orig = &real().iter().find(|(n, _)| n == MANIFEST).unwrap().1;
            let v: Value = serde_json::from_slice(orig).unwrap();
            let bytes = seal_manifest(&serde_json::to_vec_pretty(&apply(v, &e)).unwrap());
            let (dir, r) = consolidate_with(MANIFEST, &bytes);
            if let Err(e) = r {
                prop_assert!(matches!(e, Error::Io(_) | Error::Usage(_)), "{:?}", e);
                prop_assert!(e.to_string().contains(&dir.display().to_string()), "{}", e);
            }
            cleanup(&dir);
        }

        /// The same edits, the SHA-256 left as it was: refused.
        #[test]
        fn an_edited_manifest_is_refused_naming_the_checkpoint(e in edits()) {
            let orig = &real().iter().find(|(n, _)| n == MANIFEST).unwrap().1;
            let v: Value = serde_json::from_slice(orig).unwrap();
            let edited = apply(v.clone(), &e);
            let bytes = serde_json::to_vec_pretty(&edited).unwrap();
            let (dir, r) = consolidate_with(MANIFEST, &bytes);
            if edited != v {
                let e = r.expect_err("an edited manifest");
                prop_assert!(matches!(e, Error::Io(_)), "{:?}", e);
                prop_assert!(e.to_string().contains(&dir.display().to_string()), "{}", e);
            }
            cleanup(&dir);
        }
    }

    #[test]
    fn every_truncation_of_a_rank_file_is_named() {
        let (name, orig) = rank_file(1);
        // Every cut through the header, then a few through the data.
        let n = 8 + u64::from_le_bytes(orig[..8].try_into().unwrap()) as usize;
        for cut in (0..n + 8).chain((n + 8..orig.len()).step_by(997)) {
            let (dir, r) = consolidate_with(&name, &orig[..cut]);
            let e = r.expect_err("truncated").to_string();
            assert!(e.contains(&dir.join(&name).display().to_string()), "{e}");
            cleanup(&dir);
        }
    }

    /// The real manifest with `edit` applied to its JSON.
    fn edited_manifest(edit: impl FnOnce(&mut Value)) -> Vec<u8> {
        let orig = &real().iter().find(|(n, _)| n == MANIFEST).unwrap().1;
        let mut v: Value = serde_json::from_slice(orig).unwrap();
        edit(&mut v);
        seal_manifest(&serde_json::to_vec_pretty(&v).unwrap())
    }

    /// Two pieces' places swapped in the manifest (its SHA-256 made to
    /// match): each file says where its piece lies, so the swap is refused
    /// rather than loaded as permuted weights.
    #[test]
    fn swapped_pieces_are_refused() {
        let orig = &real().iter().find(|(n, _)| n == MANIFEST).unwrap().1;
        let v: Value = serde_json::from_slice(orig).unwrap();
        let mut swapped = 0;
        for (name, t) in v["tensors"].as_object().unwrap() {
            let pieces = t["pieces"].as_array().unwrap();
            // consolidate reads the parameters (a resume reads every
            // tensor through the same check).
            let param = name.starts_with("param/");
            if !param || pieces.len() != 2 || pieces[0]["shape"] != pieces[1]["shape"] {
                continue;
            }
            let key = name.replace('/', "~1");
            let bytes = edited_manifest(|v| {
                let p = v.pointer_mut(&format!("/tensors/{key}/pieces")).unwrap();
                let a = p[0]["shard"]["offset"].clone();
                p[0]["shard"]["offset"] = p[1]["shard"]["offset"].clone();
                p[1]["shard"]["offset"] = a;
            });
            let (dir, r) = consolidate_with(MANIFEST, &bytes);
            let e = r.expect_err("swapped pieces").to_string();
            assert!(
                e.contains(&dir.display().to_string()) && e.contains("the manifest was edited"),
                "{name}: {e}"
            );
            cleanup(&dir);
            swapped += 1;
        }
        assert!(swapped >= 3, "{swapped} tensors with two equal pieces");
    }

    #[test]
    fn overlapping_pieces_cannot_hide_a_hole() {
        // l1.bias is [4] in two pieces of 2: moving the second to offset 1
        // covers 0..3 with 4 values, the count of the whole; once the
        // reader zero-filled value 3.
        let bytes = edited_manifest(|v| {
            v["tensors"]["param/l1.bias"]["pieces"][1]["shard"]["offset"] = json!(1);
        });
        let (dir, r) = consolidate_with(MANIFEST, &bytes);
        let e = r.expect_err("overlapping pieces").to_string();
        assert!(
            e.contains(&dir.join(MANIFEST).display().to_string()) && e.contains("overlap"),
            "{e}"
        );
        cleanup(&dir);
    }

    #[test]
    fn a_huge_tensor_in_the_manifest_is_refused_before_any_memory_is_taken() {
        // The manifest alone says 4 TiB, or more than memory holds: the
        // file it points to refuses the claim.
        for (shape, piece) in [
            (
                json!([1u64 << 40]),
                json!({"file": 0, "shape": [1u64 << 40], "shard": null}),
            ),
            (
                json!([1u64 << 40]),
                json!({"file": 0, "shape": [10], "shard": {"dim": 0, "offset": 0, "global": 1u64 << 40}}),
            ),
            (
                json!([1u64 << 62, 4]),
                json!({"file": 0, "shape": [1u64 << 62, 4], "shard": null}),
            ),
            (
                json!([1u64 << 32, 1u64 << 32]),
                json!({"file": 0, "shape": [1u64 << 32, 1u64 << 32], "shard": null}),
            ),
        ] {
            let bytes = edited_manifest(|v| {
                v["tensors"]["param/l3.bias"] = json!({"shape": shape, "pieces": [piece]});
            });
            let (dir, r) = consolidate_with(MANIFEST, &bytes);
            let e = r.expect_err("a huge tensor").to_string();
            assert!(e.contains(&dir.display().to_string()), "{e}");
            cleanup(&dir);
        }
        // A hole: the second piece of l1.bias gone.
        let bytes = edited_manifest(|v| {
            v["tensors"]["param/l1.bias"]["pieces"]
                .as_array_mut()
                .unwrap()
                .pop();
        });
        let (dir, r) = consolidate_with(MANIFEST, &bytes);
        let e = r.expect_err("a hole").to_string();
        assert!(
            e.contains(&dir.join(MANIFEST).display().to_string()) && e.contains("cover 2 of the 4"),
            "{e}"
        );
        cleanup(&dir);
    }
}

/// The hand-made files of `tests/corpus/`.
mod corpus {
    use super::*;
    use std::path::Path;

    /// Each corpus directory and the parse its files go through.
    type Parse = fn(&[u8], &str) -> Result<(), Error>;

    /// The corpus directories (under `tests/corpus/`) and their parsers.
    const CORPORA: [(&str, Parse); 3] = [
        ("idx", idx::parse),
        ("cifar", cifar::parse),
        ("checkpoint", checkpoint::parse),
    ];

    /// Every file of every corpus: `ok-*` parses, `err-*` is an error
    /// naming it, anything else (bar `.gitkeep` and `README*`) is a
    /// misnamed corpus file; each corpus holds both kinds; files stay
    /// under 4 KB.
    #[test]
    fn every_file_has_its_expected_outcome() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
        for (dir, parse) in CORPORA {
            let mut seen = (0, 0);
            let mut entries: Vec<_> = std::fs::read_dir(root.join(dir))
                .unwrap_or_else(|e| panic!("tests/corpus/{dir}: {e}"))
                .map(|e| e.expect("a directory entry").path())
                .collect();
            entries.sort();
            for path in entries {
                let file = path.file_name().unwrap().to_string_lossy().into_owned();
                if file == ".gitkeep" || file.starts_with("README") {
                    continue;
                }
                let bytes = std::fs::read(&path).unwrap();
                assert!(bytes.len() < 4096, "{dir}/{file}: {} bytes", bytes.len());
                let name = format!("corpus/{dir}/{file}");
                let r = parse(&bytes, &name);
                if file.starts_with("ok-") {
                    assert!(r.is_ok(), "{name}: {r:?}");
                    seen.0 += 1;
                } else if file.starts_with("err-") {
                    let e = r.expect_err(&name).to_string();
                    assert!(e.contains(&name), "{name} not named in: {e}");
                    seen.1 += 1;
                } else {
                    panic!("tests/corpus/{dir}/{file}: name it ok-* or err-*");
                }
            }
            assert!(seen.0 > 0 && seen.1 > 0, "{dir}: {seen:?} (ok, err) files");
        }
    }
}
