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
//! them. To add a reader (the checkpoint reader is next; its corpus
//! directory `tests/corpus/checkpoint/` is ready): a module like
//! [`cifar`], and a line in [`corpus::CORPORA`].
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

/// The hand-made files of `tests/corpus/`.
mod corpus {
    use super::*;
    use std::path::Path;

    /// Each corpus directory and the parse its files go through.
    type Parse = fn(&[u8], &str) -> Result<(), Error>;

    /// The corpus directories (under `tests/corpus/`) and their parsers.
    /// `checkpoint/` joins when the checkpoint reader's section does.
    const CORPORA: [(&str, Parse); 2] = [("idx", idx::parse), ("cifar", cifar::parse)];

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
