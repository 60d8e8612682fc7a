//! The source layout (`docs/layout.md`, linked from the README) against the
//! tree: every path it lists exists, every top-level module of `src/` has a
//! line, every module of a listed `src/` directory is named on its line, and
//! every document (or directory of them) in `docs/` is named. (A new
//! contributor reads the layout first; it had drifted.)

use std::collections::BTreeSet;
use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The Layout block: (path in the first column, its description lines).
fn layout() -> Vec<(String, String)> {
    let layout = std::fs::read_to_string(root().join("docs/layout.md")).unwrap();
    let block = layout
        .split("\n```\n")
        .nth(1)
        .expect("docs/layout.md has a code block");
    let mut entries: Vec<(String, String)> = Vec::new();
    for line in block.lines() {
        if line.starts_with(' ') {
            let last = entries.last_mut().expect("a continuation line first");
            last.1.push(' ');
            last.1.push_str(line.trim());
        } else if let Some((path, desc)) = line.split_once(' ') {
            entries.push((path.to_string(), desc.trim().to_string()));
        } else if !line.is_empty() {
            entries.push((line.to_string(), String::new()));
        }
    }
    entries
}

/// Words of a description that name a file or directory.
fn named_paths(desc: &str) -> Vec<String> {
    desc.split(|c: char| c.is_whitespace() || ",()`".contains(c))
        .filter(|w| {
            w.len() > 1
                && !w.contains('*')
                && [".rs", ".md", ".sh", ".json", ".toml", "/"]
                    .iter()
                    .any(|ext| w.ends_with(ext))
        })
        .map(str::to_string)
        .collect()
}

/// A directory's modules: `.rs` files that are not tests or `mod.rs`, and
/// subdirectories that are modules of their own (no sibling `<name>.rs`).
fn modules(dir: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if path.is_dir() {
            if !dir.join(format!("{name}.rs")).exists() {
                out.insert(format!("{name}/"));
            }
        } else if name.ends_with(".rs")
            && name != "mod.rs"
            && !name.ends_with("_tests.rs")
            && name != "tests.rs"
        {
            out.insert(name);
        }
    }
    out
}

#[test]
fn every_path_the_layout_lists_exists() {
    let mut missing = Vec::new();
    for (path, desc) in layout() {
        if !root().join(&path).exists() {
            missing.push(path.clone());
        }
        let base = if path.ends_with('/') {
            root().join(&path)
        } else {
            root().to_path_buf()
        };
        for named in named_paths(&desc) {
            // `docs/waits.md` in a file's line is from the top; in a
            // directory's line a bare name is inside that directory.
            let at = if named.trim_end_matches('/').contains('/') {
                root().join(&named)
            } else if path.ends_with('/') {
                base.join(&named)
            } else {
                continue;
            };
            if !at.exists() {
                missing.push(format!("{named} (on the line of {path})"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/layout.md lists what does not exist: {missing:?}"
    );
}

#[test]
fn every_module_and_document_is_in_the_layout() {
    let entries = layout();
    let listed: BTreeSet<String> = entries.iter().map(|(p, _)| p.clone()).collect();
    let mut absent = Vec::new();
    for module in modules(&root().join("src")) {
        let path = format!("src/{module}");
        // A module with a directory of submodules may be listed by them (`src/job/payload.rs`).
        let dir = format!("src/{}/", module.trim_end_matches(".rs"));
        let by_child = listed.iter().any(|l| l.starts_with(&dir));
        if !listed.contains(&path) && !by_child {
            absent.push(path);
        }
    }
    for (path, desc) in &entries {
        if !(path.starts_with("src/") && path.ends_with('/')) {
            continue;
        }
        let named: BTreeSet<String> = named_paths(desc).into_iter().collect();
        for module in modules(&root().join(path)) {
            if !named.contains(&module) {
                absent.push(format!("{path}{module}"));
            }
        }
    }
    let docs_line = entries
        .iter()
        .find(|(p, _)| p == "docs/")
        .map(|(_, d)| named_paths(d))
        .unwrap_or_default();
    for entry in std::fs::read_dir(root().join("docs")).unwrap().flatten() {
        let mut name = entry.file_name().to_string_lossy().into_owned();
        if entry.path().is_dir() {
            name.push('/');
        }
        if !docs_line.contains(&name) {
            absent.push(format!("docs/{name}"));
        }
    }
    assert!(
        absent.is_empty(),
        "docs/layout.md does not mention: {absent:?}"
    );
}
