//! The layering of ARCHITECTURE.md, checked on the source: every
//! `crate::<module>` path in a top-level module of `src/` must name a
//! module that the "may import" column of ARCHITECTURE.md's layer table
//! allows it, and no two top-level modules may import each other, directly
//! or round a circle. The table is read from ARCHITECTURE.md itself, so the
//! document and the code cannot drift apart: allowing a new import means
//! writing it into the table.
//!
//! Comments (and doc links in them) do not count; `crate::Error`,
//! `crate::Result` and the other items re-exported at the crate root do not
//! name a module and are allowed everywhere, as is `error`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The top-level modules of `src/` (folders and files, not `lib.rs` and
/// `main.rs`).
fn modules(src: &Path) -> BTreeSet<String> {
    std::fs::read_dir(src)
        .expect("src/")
        .filter_map(|e| {
            let p = e.ok()?.path();
            let name = p.file_stem()?.to_str()?.to_string();
            let rust = p.is_dir() || p.extension().is_some_and(|x| x == "rs");
            (rust && name != "lib" && name != "main").then_some(name)
        })
        .collect()
}

/// Every `.rs` file of module `m`.
fn files(src: &Path, m: &str) -> Vec<PathBuf> {
    let dir = src.join(m);
    if !dir.is_dir() {
        return vec![src.join(format!("{m}.rs"))];
    }
    let mut out = Vec::new();
    let mut todo = vec![dir];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("a module folder").flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out
}

/// The modules named by `crate::<name>` in `text`, comments left out.
fn imports(text: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if known.contains(&name) {
                out.insert(name);
            }
        }
    }
    out
}

/// ARCHITECTURE.md's table: module → what it may import.
fn allowed(doc: &str, known: &BTreeSet<String>) -> BTreeMap<String, BTreeSet<String>> {
    let mut order: Vec<String> = Vec::new();
    let mut out = BTreeMap::new();
    for line in doc.lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 5 {
            continue;
        }
        let (place, may) = (cells[2], cells[cells.len() - 2]);
        // `src/comm/`, `src/output.rs`, `src/bench.rs` (hidden)
        let Some(path) = place.strip_prefix("`src/") else {
            continue;
        };
        let name: String = path
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !known.contains(&name) {
            continue;
        }
        let set: BTreeSet<String> = if may.starts_with("everything above") {
            order.iter().cloned().collect()
        } else if may.starts_with("everything but ") {
            let but = may.trim_start_matches("everything but ").trim();
            known
                .iter()
                .filter(|m| m.as_str() != but && **m != name)
                .cloned()
                .collect()
        } else if may.starts_with("everything") || may.is_empty() {
            known.iter().filter(|m| **m != name).cloned().collect()
        } else {
            may.split([',', ' '])
                .map(str::trim)
                .filter(|w| known.contains(*w))
                .map(String::from)
                .collect()
        };
        order.push(name.clone());
        out.insert(name, set);
    }
    out
}

/// A circle in `graph`, if any, as the modules round it.
fn circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut c = path[i..].to_vec();
            c.push(m.to_string());
            return Some(c);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for d in graph.get(m).into_iter().flatten() {
            if let Some(c) = visit(d, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|m| visit(m, graph, &mut Vec::new(), &mut done))
}

#[test]
fn imports_follow_the_layers_of_architecture_md() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("src");
    let known = modules(&src);
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let table = allowed(&doc, &known);
    let mut graph = BTreeMap::new();
    let mut wrong = Vec::new();
    for m in &known {
        let Some(may) = table.get(m) else {
            if m != "error" {
                wrong.push(format!(
                    "src/{m} has no row in ARCHITECTURE.md's layer table"
                ));
            }
            continue;
        };
        let mut deps = BTreeSet::new();
        for f in files(&src, m) {
            let text = std::fs::read_to_string(&f).expect("a source file");
            for d in imports(&text, &known) {
                if d != *m && d != "error" && !may.contains(&d) {
                    wrong.push(format!(
                        "{} imports crate::{d}, which ARCHITECTURE.md does not let {m} import",
                        f.strip_prefix(root).unwrap_or(&f).display()
                    ));
                }
                if d != *m {
                    deps.insert(d);
                }
            }
        }
        graph.insert(m.clone(), deps);
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    if let Some(c) = circle(&graph) {
        panic!(
            "modules import each other round a circle: {}",
            c.join(" → ")
        );
    }
    // The table itself names something: the check cannot pass vacuously.
    assert!(
        table.len() >= 10,
        "only {} rows read: {table:?}",
        table.len()
    );
    assert!(table["functions"].contains("comm") && !table["comm"].contains("functions"));
}

#[test]
fn the_circle_finder_finds_circles() {
    let g = |edges: &[(&str, &str)]| {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    assert_eq!(circle(&g(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
    let c = circle(&g(&[("a", "b"), ("b", "c"), ("c", "a")])).expect("a → b → c → a");
    assert_eq!(c.first(), c.last());
    assert_eq!(c.len(), 4);
}
