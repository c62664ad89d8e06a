//! The data caches this CPU reports, which the GEMMs' block sizes are
//! computed from (`sgemm`'s and `dot`'s `blocking`).

use std::sync::OnceLock;

/// Per-core data cache sizes, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caches {
    /// The level-1 data cache.
    pub l1d: usize,
    /// The level-2 cache.
    pub l2: usize,
}

impl Caches {
    /// What is assumed where the CPU reports nothing: 32 KiB and 1 MiB,
    /// the smallest of the x86-64 server cores of the last years.
    pub const FALLBACK: Caches = Caches {
        l1d: 32 << 10,
        l2: 1 << 20,
    };
}

/// This CPU's caches, read once per process (Linux's
/// `/sys/devices/system/cpu/cpu0/cache`; [`Caches::FALLBACK`] elsewhere,
/// or for a level it does not list).
pub fn caches() -> Caches {
    static CACHES: OnceLock<Caches> = OnceLock::new();
    *CACHES.get_or_init(|| read_sysfs("/sys/devices/system/cpu/cpu0/cache"))
}

/// The caches listed under `dir` (`index*/level`, `type`, `size`).
fn read_sysfs(dir: &str) -> Caches {
    let mut found = Caches::FALLBACK;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for e in entries.flatten() {
        let p = e.path();
        let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
        let (level, kind) = (read("level"), read("type"));
        let Some(size) = parse_size(read("size").trim()) else {
            continue;
        };
        match (level.trim(), kind.trim()) {
            ("1", "Data") => found.l1d = size,
            ("2", "Unified" | "Data") => found.l2 = size,
            _ => {}
        }
    }
    found
}

/// `32K`, `1024K`, `2M` or a plain byte count.
fn parse_size(s: &str) -> Option<usize> {
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let n: usize = digits.parse().ok()?;
    let scale = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        _ => return None,
    };
    n.checked_mul(scale).filter(|&b| b > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_size("32K"), Some(32 << 10));
        assert_eq!(parse_size("2M"), Some(2 << 20));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("0K"), None);
        assert_eq!(parse_size("12Q"), None);
        assert_eq!(parse_size(""), None);
    }

    #[test]
    fn a_missing_folder_gives_the_fallback() {
        assert_eq!(read_sysfs("/nonexistent/cache"), Caches::FALLBACK);
    }

    #[test]
    fn a_listed_folder_is_read() {
        let dir = std::env::temp_dir().join(format!("shardnet-caches-{}", std::process::id()));
        for (i, level, kind, size) in [
            (0, "1", "Data", "48K"),
            (1, "1", "Instruction", "32K"),
            (2, "2", "Unified", "2048K"),
        ] {
            let d = dir.join(format!("index{i}"));
            std::fs::create_dir_all(&d).expect("a temporary folder");
            for (f, v) in [("level", level), ("type", kind), ("size", size)] {
                std::fs::write(d.join(f), format!("{v}\n")).expect("a temporary file");
            }
        }
        let got = read_sysfs(dir.to_str().expect("a UTF-8 path"));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            got,
            Caches {
                l1d: 48 << 10,
                l2: 2 << 20
            }
        );
    }
}
