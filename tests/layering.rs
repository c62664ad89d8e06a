//! What the compiler cannot check of ARCHITECTURE.md's layering. Between
//! crates it can: `shardnet-comm` and `shardnet-kernels` do not depend on
//! `shardnet`, so an upward import there does not compile. Inside the
//! `shardnet` crate, every `crate::<module>` path in a top-level module of
//! `crates/shardnet/src/` must name a module that the "may import" column
//! of ARCHITECTURE.md's layer table allows it, and no two top-level modules
//! may import each other, directly or round a circle. The table is read
//! from ARCHITECTURE.md itself, so the document and the code cannot drift
//! apart: allowing a new import means writing it into the table. In every
//! crate, files of one module do not import each other round a circle.
//!
//! Comments (and doc links in them) do not count; `crate::Error`,
//! `crate::Result` and the other items re-exported at the crate root do not
//! name a module and are allowed everywhere, as are the crates below
//! (`comm`, `kernels`, `rng`, `error`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The top-level modules of a crate's `src` (folders and files, not
/// `lib.rs` and `main.rs`).
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
        // `crates/shardnet/src/train/`; the crates' rows name no module.
        let Some(path) = place.strip_prefix("`crates/shardnet/src/") else {
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
    let src = root.join("crates/shardnet/src");
    let known = modules(&src);
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let table = allowed(&doc, &known);
    let mut graph = BTreeMap::new();
    let mut wrong = Vec::new();
    for m in &known {
        let Some(may) = table.get(m) else {
            if m != "error" {
                wrong.push(format!(
                    "crates/shardnet/src/{m} has no row in ARCHITECTURE.md's layer table"
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
        table.len() >= 8,
        "only {} rows read: {table:?}",
        table.len()
    );
    assert!(table["train"].contains("nn") && !table["nn"].contains("train"));
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

/// Code of `text` without comments (line comments, doc comments).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The names `super::` paths in `code` reach `ups` levels up (`ups`
/// repetitions of `super::`), single or in a `{…}` group:
/// `super::a::f`, `super::{a, b::c}` give a and b.
fn reached(code: &str, ups: usize) -> BTreeSet<String> {
    let word = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("super::") {
        // A whole chain of `super::`: one of exactly `ups` links reaches
        // the folder asked about.
        rest = &rest[i..];
        let mut n = 0;
        while let Some(r) = rest.strip_prefix("super::") {
            rest = r;
            n += 1;
        }
        if n != ups {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0usize;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.insert(word(item.trim()));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 || c != '{' {
                    item.push(c);
                }
            }
            out.insert(word(item.trim()));
        } else {
            out.insert(word(rest));
        }
    }
    out.remove("");
    out
}

/// For every module folder under a crate's `src`, which of its children (files but
/// `mod.rs`, and subfolders) import which siblings through `super::`.
fn sibling_graphs(src: &Path) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![src.to_path_buf()];
    while let Some(dir) = todo.pop() {
        let mut children: BTreeMap<String, PathBuf> = BTreeMap::new();
        for e in std::fs::read_dir(&dir).expect("a folder").flatten() {
            let p = e.path();
            let name = p
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("")
                .to_string();
            if p.is_dir() {
                todo.push(p.clone());
                children.insert(name, p);
            } else if p.extension().is_some_and(|x| x == "rs")
                && !["mod", "lib", "main"].contains(&name.as_str())
            {
                children.insert(name, p);
            }
        }
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (name, path) in &children {
            let mut deps = BTreeSet::new();
            // (file, how many `super::` reach this folder's children)
            let files: Vec<(PathBuf, usize)> = if path.is_dir() {
                let mut fs = Vec::new();
                let mut walk = vec![(path.clone(), 1usize)];
                while let Some((d, ups)) = walk.pop() {
                    for e in std::fs::read_dir(&d).expect("a folder").flatten() {
                        let p = e.path();
                        if p.is_dir() {
                            walk.push((p, ups + 1));
                        } else if p.extension().is_some_and(|x| x == "rs") {
                            let own = p.file_stem().is_some_and(|s| s == "mod");
                            fs.push((p, if own { ups } else { ups + 1 }));
                        }
                    }
                }
                fs
            } else {
                vec![(path.clone(), 1)]
            };
            for (f, ups) in files {
                let text = code(&std::fs::read_to_string(&f).expect("a source file"));
                for d in reached(&text, ups) {
                    if d != *name && children.contains_key(&d) {
                        deps.insert(d);
                    }
                }
            }
            graph.insert(name.clone(), deps);
        }
        let rel = dir.strip_prefix(src).unwrap_or(&dir).display().to_string();
        out.insert(rel, graph);
    }
    out
}

/// The sets of siblings that import each other round a circle (strongly
/// connected components of more than one), by folder.
fn sibling_circles(src: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (dir, graph) in sibling_graphs(src) {
        // Reachability by repeated expansion: the graphs are small.
        let reach = |from: &str| {
            let mut seen: BTreeSet<String> = BTreeSet::new();
            let mut todo = vec![from.to_string()];
            while let Some(m) = todo.pop() {
                for d in graph.get(&m).into_iter().flatten() {
                    if seen.insert(d.clone()) {
                        todo.push(d.clone());
                    }
                }
            }
            seen
        };
        for m in graph.keys() {
            let r = reach(m);
            let mut scc: Vec<String> = graph
                .keys()
                .filter(|o| *o == m || (r.contains(*o) && reach(o).contains(m)))
                .cloned()
                .collect();
            if scc.len() > 1 {
                scc.sort();
                out.insert(format!("{dir}: {}", scc.join(", ")));
            }
        }
    }
    out
}

/// Files of one module do not import each other round a circle (through
/// `super::` paths; a child's use of its parent's own items is not one):
/// `known` lists any that is accepted for a while, and a listed one that
/// is gone fails too, so that the list stays what the code is.
#[test]
fn files_within_a_module_import_no_new_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let known: BTreeSet<String> = BTreeSet::new();
    let mut found = BTreeSet::new();
    for krate in [
        "src",
        "crates/comm/src",
        "crates/kernels/src",
        "crates/shardnet/src",
        "crates/conformance/src",
    ] {
        for c in sibling_circles(&root.join(krate)) {
            found.insert(format!("{krate}/{c}"));
        }
    }
    let new: Vec<_> = found.difference(&known).collect();
    let gone: Vec<_> = known.difference(&found).collect();
    assert!(
        new.is_empty(),
        "files import each other round a circle: {new:?}"
    );
    assert!(gone.is_empty(), "broken, take them off the list: {gone:?}");
}

#[test]
fn the_sibling_reader_reads_paths_and_groups() {
    let text = "use super::a::f;\nuse super::{b, c::g};\nlet x = super::super::d::h;\n// super::e";
    let code = code(text);
    assert_eq!(
        reached(&code, 1),
        ["a", "b", "c"].iter().map(|s| s.to_string()).collect()
    );
    assert_eq!(
        reached(&code, 2),
        ["d"].iter().map(|s| s.to_string()).collect()
    );
}
