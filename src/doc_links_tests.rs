//! Every relative link in README.md and the documents under `docs/`
//! resolves: the file (or directory) it names exists, and a `#anchor` names a
//! heading of the target document by GitHub's slug of it. The README is a
//! front door into the user guide in `docs/guide/`; a link that breaks when a
//! section moves is a dead end for the reader, so the suite fails on it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every `.md` under `docs/`, recursively.
fn documents() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let mut out = vec![root().join("README.md")];
    walk(&root().join("docs"), &mut out);
    out.sort();
    out
}

/// The lines of `text` outside fenced code blocks (```` ``` ```` or `~~~`),
/// with `None` in place of a line inside one.
fn prose_lines(text: &str) -> Vec<Option<&str>> {
    let mut fence: Option<&str> = None;
    text.lines()
        .map(|line| {
            let t = line.trim_start();
            match fence {
                Some(f) if t.starts_with(f) => {
                    fence = None;
                    None
                }
                Some(_) => None,
                None if t.starts_with("```") || t.starts_with("~~~") => {
                    fence = Some(&t[..3]);
                    None
                }
                None => Some(line),
            }
        })
        .collect()
}

/// GitHub's anchor for a heading's text: lower case, inline code marks and
/// punctuation dropped (letters, digits, `_`, `-` and spaces kept), spaces
/// made `-`; a link in a heading counts by its text.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading.trim();
    // `[text](target)` → `text`.
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](").map(|i| open + i) else {
            break;
        };
        let Some(end) = rest[close..].find(')').map(|i| close + i) else {
            break;
        };
        text.push_str(&rest[..open]);
        text.push_str(&rest[open + 1..close]);
        rest = &rest[end + 1..];
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a document's headings, a repeated one numbered `-1`,
/// `-2`, ... as GitHub numbers them.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in prose_lines(text).into_iter().flatten() {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(line[hashes..].trim_end_matches('#'));
        let mut anchor = base.clone();
        let mut n = 0;
        while out.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        out.insert(anchor);
    }
    out
}

/// The targets of the inline links `[text](target)` in a document's prose
/// (not in code blocks or code spans), with the line each is on.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    // Paragraph by paragraph, since a code span or a link's text may run
    // over a line break but never over a blank line.
    let mut paragraph: Vec<(usize, &str)> = Vec::new();
    let lines = prose_lines(text);
    for (i, line) in lines.iter().enumerate() {
        match line {
            Some(l) if !l.trim().is_empty() => paragraph.push((i + 1, l)),
            _ => {
                links_in(&paragraph, &mut out);
                paragraph.clear();
            }
        }
    }
    links_in(&paragraph, &mut out);
    out
}

fn links_in(paragraph: &[(usize, &str)], out: &mut Vec<(usize, String)>) {
    // The paragraph's text with code spans blanked, each char's line kept.
    let mut chars: Vec<(usize, char)> = Vec::new();
    for (n, l) in paragraph {
        chars.extend(l.chars().map(|c| (*n, c)));
        chars.push((*n, '\n'));
    }
    let mut i = 0;
    while i < chars.len() {
        if chars[i].1 != '`' {
            i += 1;
            continue;
        }
        let run = chars[i..].iter().take_while(|c| c.1 == '`').count();
        // The closing run of the same length, if any; else a literal backtick.
        let mut j = i + run;
        let mut close = None;
        while j < chars.len() {
            if chars[j].1 == '`' {
                let r = chars[j..].iter().take_while(|c| c.1 == '`').count();
                if r == run {
                    close = Some(j + r);
                    break;
                }
                j += r;
            } else {
                j += 1;
            }
        }
        match close {
            Some(end) => {
                for c in &mut chars[i..end] {
                    c.1 = ' ';
                }
                i = end;
            }
            None => i += run,
        }
    }
    let text: String = chars.iter().map(|c| c.1).collect();
    let lines: Vec<usize> = chars.iter().map(|c| c.0).collect();
    let mut from = 0;
    while let Some(at) = text[from..].find("](").map(|i| from + i) {
        let start = at + 2;
        let end = text[start..]
            .find([')', ' ', '\n'])
            .map_or(text.len(), |i| start + i);
        let line = lines[text[..at].chars().count()];
        out.push((line, text[start..end].to_string()));
        from = end;
    }
}

/// What is wrong with each relative link of `doc` (`text` is its content).
fn broken(doc: &Path, text: &str) -> Vec<String> {
    let mut wrong = Vec::new();
    let name = doc
        .strip_prefix(root())
        .unwrap_or(doc)
        .display()
        .to_string();
    for (line, target) in links(text) {
        if target.contains(':') || target.is_empty() {
            continue; // https:, mailto: — not ours to check
        }
        let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
        let file = if path.is_empty() {
            doc.to_path_buf()
        } else {
            doc.parent().unwrap().join(path)
        };
        if !file.exists() {
            wrong.push(format!("{name}:{line}: {target}: no such file"));
            continue;
        }
        if anchor.is_empty() || file.extension().is_none_or(|e| e != "md") {
            continue;
        }
        let target_text = if path.is_empty() {
            text.to_string()
        } else {
            std::fs::read_to_string(&file).unwrap()
        };
        if !anchors(&target_text).contains(anchor) {
            wrong.push(format!(
                "{name}:{line}: {target}: no heading with that anchor"
            ));
        }
    }
    wrong
}

#[test]
fn every_relative_link_in_the_readme_and_docs_resolves() {
    let docs = documents();
    assert!(
        docs.iter().any(|d| d.ends_with("docs/guide/pausing.md")),
        "the walk finds the user guide: {docs:?}"
    );
    let mut wrong = Vec::new();
    let mut checked = 0;
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        checked += links(&text).len();
        wrong.extend(broken(doc, &text));
    }
    assert!(
        checked > 50,
        "only {checked} links found: the parser lost them"
    );
    assert!(wrong.is_empty(), "broken links:\n{}", wrong.join("\n"));
}

#[test]
fn slugs_are_githubs() {
    assert_eq!(
        slug("Stepping into an environment: `dormant shell`"),
        "stepping-into-an-environment-dormant-shell"
    );
    assert_eq!(slug("Warm machines (qemu)"), "warm-machines-qemu");
    assert_eq!(
        slug("SSH transport (ssh, ec2 and qemu)"),
        "ssh-transport-ssh-ec2-and-qemu"
    );
    assert_eq!(slug("`dormant_*` & co."), "dormant_--co");
    assert_eq!(slug("See [the guide](docs/x.md)"), "see-the-guide");
    let doc = "# A\n```\n# not a heading\n```\n## A\n#not one\n";
    assert_eq!(
        anchors(doc),
        BTreeSet::from(["a".to_string(), "a-1".to_string()])
    );
}

#[test]
fn a_broken_link_or_anchor_is_found_and_code_is_not_read() {
    let doc = root().join("README.md");
    let text = "# Top\n\nSee [the top](#top), [gone](#nowhere), [x](docs/no-such.md),\n\
                [a section](docs/pause.md#no-such-heading) and\n\
                `[in code](missing.md)`.\n\n```\n[in a block](missing.md)\n```\n";
    let found = broken(&doc, text);
    assert_eq!(found.len(), 3, "{found:?}");
    assert!(found[0].contains("README.md:3: #nowhere"), "{found:?}");
    assert!(
        found[1].contains("docs/no-such.md: no such file"),
        "{found:?}"
    );
    assert!(
        found[2].contains("no-such-heading: no heading"),
        "{found:?}"
    );
}
