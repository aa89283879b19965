//! The crates' module layering: no import circles. Within each folder the
//! modules (files and sub-folders) that import one another must form no
//! cycle, so each folder reads bottom-up and a change to one module never
//! has to reach around to a module that depends on it. Test-only modules
//! (`#[cfg(test)] mod ...`) are left out: a test may reach anywhere.
//!
//! The check is lexical: it reads `use` trees and inline `crate::`,
//! `super::`, `self::` and child-module paths from the source, with
//! comments removed, and resolves each to the longest module it names.
//! That is exact for this codebase's style (no glob re-exports across
//! folders, no macros that name modules).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path from the crate root (`["sinks", "detect", "host"]`); the
/// root is empty.
type ModPath = Vec<String>;

/// A source file and the module it is.
struct ModFile {
    path: PathBuf,
    module: ModPath,
}

/// Every module file of a crate whose root is `src/main.rs` or
/// `src/lib.rs`, following `mod` declarations (so only compiled files
/// count), without the test-only ones.
fn module_files(src: &Path) -> Vec<ModFile> {
    let root = ["lib.rs", "main.rs"]
        .iter()
        .map(|f| src.join(f))
        .find(|p| p.exists());
    let mut out = Vec::new();
    let mut todo: Vec<(PathBuf, ModPath)> = root.into_iter().map(|p| (p, Vec::new())).collect();
    while let Some((path, module)) = todo.pop() {
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        // Where this file's child modules live: `a/` beside `a.rs`, or the
        // folder of a `mod.rs`/crate root.
        let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let dir = if matches!(file_name, "mod.rs" | "lib.rs" | "main.rs") {
            path.parent().unwrap().to_path_buf()
        } else {
            path.with_extension("")
        };
        for child in declared_modules(&text) {
            let file = [
                dir.join(format!("{child}.rs")),
                dir.join(&child).join("mod.rs"),
            ]
            .into_iter()
            .find(|p| p.exists());
            if let Some(file) = file {
                let mut m = module.clone();
                m.push(child);
                todo.push((file, m));
            }
        }
        out.push(ModFile { path, module });
    }
    out
}

/// The text without comments (line and block) and string literals, which
/// could hold anything that looks like a path.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' && i + 2 < b.len() && (b[i + 2] == b'\'' || b[i + 1] == b'\\') {
            // A char literal ('{', '\n'); lifetimes ('a) pass through.
            let end = b[i + 1..]
                .iter()
                .position(|&c| c == b'\'')
                .map_or(b.len(), |p| i + 2 + p);
            i = end;
            out.push_str("' '");
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// The code with every `#[cfg(test)]` item removed (a `mod x;` line or a
/// braced item).
fn without_test_items(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        // The item ends at its first `;` before any `{`, or at the `}`
        // closing its first `{`.
        let semi = after.find(';');
        let brace = after.find('{');
        let end = match (semi, brace) {
            (Some(s), Some(b)) if s < b => s + 1,
            (Some(s), None) => s + 1,
            (_, Some(b)) => {
                let mut depth = 0usize;
                let mut end = after.len();
                for (i, c) in after[b..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = b + i + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (None, None) => after.len(),
        };
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// `mod name;` declarations outside test items.
fn declared_modules(text: &str) -> Vec<String> {
    let code = without_test_items(&code_only(text));
    let mut names = Vec::new();
    for line in code.lines() {
        let line = line.trim();
        let line = line
            .strip_prefix("pub(crate) ")
            .or_else(|| line.strip_prefix("pub(super) "))
            .or_else(|| line.strip_prefix("pub "))
            .unwrap_or(line);
        if let Some(name) = line.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
            names.push(name.trim().to_string());
        }
    }
    names
}

/// Expands a `use` tree (`a::{b, c::{d, e}}`) into its paths.
fn expand_use_tree(tree: &str, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let tree = tree.trim();
    if tree.is_empty() {
        return;
    }
    // Split on the first `{` that is at this level.
    if let Some(open) = tree.find('{') {
        let head: Vec<String> = tree[..open]
            .split("::")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        let close = tree.rfind('}').unwrap_or(tree.len());
        let inner = &tree[open + 1..close];
        let mut base = prefix.to_vec();
        base.extend(head);
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand_use_tree(&inner[start..i], &base, out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        expand_use_tree(&inner[start..], &base, out);
        return;
    }
    let path = tree.split(" as ").next().unwrap_or(tree);
    let mut p = prefix.to_vec();
    // `self` inside a group names the group's own path.
    let inside_group = !prefix.is_empty();
    p.extend(
        path.split("::")
            .map(str::trim)
            .filter(|s| !(s.is_empty() || inside_group && *s == "self"))
            .map(String::from),
    );
    out.push(p);
}

/// Every path the module's code names: `use` trees, and inline paths of
/// two segments or more.
fn named_paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = code;
    // `use` statements.
    let mut others = String::with_capacity(code.len());
    loop {
        let at = rest
            .match_indices("use ")
            .find(|(i, _)| *i == 0 || !is_ident(rest[..*i].chars().next_back().unwrap_or(' ')));
        let Some((at, _)) = at else {
            others.push_str(rest);
            break;
        };
        others.push_str(&rest[..at]);
        let end = rest[at..].find(';').map_or(rest.len(), |e| at + e);
        expand_use_tree(&rest[at + 4..end], &[], &mut out);
        rest = &rest[end.min(rest.len())..];
        if rest.is_empty() {
            break;
        }
        rest = &rest[1..];
    }
    // Inline paths: maximal runs of `ident::ident::...`.
    let chars: Vec<char> = others.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if is_ident(chars[i]) && (i == 0 || !is_ident(chars[i - 1]) && chars[i - 1] != ':') {
            let mut segs = Vec::new();
            let mut j = i;
            loop {
                let s = j;
                while j < chars.len() && is_ident(chars[j]) {
                    j += 1;
                }
                segs.push(chars[s..j].iter().collect::<String>());
                if j + 2 < chars.len()
                    && chars[j] == ':'
                    && chars[j + 1] == ':'
                    && is_ident(chars[j + 2])
                {
                    j += 2;
                } else {
                    break;
                }
            }
            if segs.len() > 1 {
                out.push(segs);
            }
            i = j.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// The modules `m`'s code refers to, each resolved to the longest module
/// of the crate its path names.
fn imports(m: &ModFile, known: &BTreeSet<ModPath>) -> BTreeSet<ModPath> {
    let text = std::fs::read_to_string(&m.path).unwrap_or_default();
    let code = without_test_items(&code_only(&text));
    let mut deps = BTreeSet::new();
    for path in named_paths(&code) {
        let Some(first) = path.first() else { continue };
        let (mut base, rest): (ModPath, &[String]) = match first.as_str() {
            "crate" => (Vec::new(), &path[1..]),
            "self" => (m.module.clone(), &path[1..]),
            "super" => {
                let ups = path.iter().take_while(|s| *s == "super").count();
                if ups > m.module.len() {
                    continue;
                }
                (m.module[..m.module.len() - ups].to_vec(), &path[ups..])
            }
            // A child module named bare (`use child::Thing`).
            _ => (m.module.clone(), &path[..]),
        };
        base.extend(rest.iter().cloned());
        let resolved = (0..=base.len())
            .rev()
            .map(|n| base[..n].to_vec())
            .find(|p| known.contains(p));
        let bare = !matches!(first.as_str(), "crate" | "self" | "super");
        // A bare path counts only when it names a child module (else it is
        // another crate's, `std::...`).
        if let Some(r) = resolved
            && r != m.module
            && (!bare || r.len() > m.module.len())
        {
            deps.insert(r);
        }
    }
    deps
}

/// The import circles among the modules of each folder: (folder, the
/// modules of one circle).
pub fn circles(src: &Path) -> Vec<(String, Vec<String>)> {
    let files = module_files(src);
    let known: BTreeSet<ModPath> = files.iter().map(|f| f.module.clone()).collect();
    let deps: BTreeMap<ModPath, BTreeSet<ModPath>> = files
        .iter()
        .map(|f| (f.module.clone(), imports(f, &known)))
        .collect();
    // Each folder's children, and edges between them lifted from every
    // module inside each.
    let mut folders: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for m in &known {
        if let Some((_, parent)) = m.split_last() {
            folders
                .entry(parent.to_vec())
                .or_default()
                .insert(m.clone());
        }
    }
    let mut found = Vec::new();
    for (folder, kids) in &folders {
        let kids: Vec<&ModPath> = kids.iter().collect();
        let child_of = |m: &ModPath| kids.iter().position(|k| m.starts_with(k));
        let mut edges = vec![BTreeSet::new(); kids.len()];
        for (m, ds) in &deps {
            let Some(a) = child_of(m) else { continue };
            for d in ds {
                if let Some(b) = child_of(d)
                    && a != b
                {
                    edges[a].insert(b);
                }
            }
        }
        for comp in strongly_connected(&edges) {
            if comp.len() > 1 {
                let mut names: Vec<String> = comp
                    .iter()
                    .map(|&i| kids[i].last().unwrap().clone())
                    .collect();
                names.sort();
                found.push((folder.join("/"), names));
            }
        }
    }
    found
}

/// Tarjan's strongly connected components of a small graph.
fn strongly_connected(edges: &[BTreeSet<usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        edges: &'a [BTreeSet<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        stack: Vec<usize>,
        on_stack: Vec<bool>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State<'_>, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in s.edges[v].iter() {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                _ => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(comp);
        }
    }
    let n = edges.len();
    let mut s = State {
        edges,
        index: vec![None; n],
        low: vec![0; n],
        stack: Vec::new(),
        on_stack: vec![false; n],
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The workspace's crates, by their source folder.
    const CRATES: &[&str] = &[
        "agent/src",
        "userspace-probes/src",
        "perfetto/src",
        "ebpf/common/src",
        "tests/src",
        "xtask/src",
    ];

    #[test]
    fn no_crate_has_an_import_circle() {
        let root = crate::root();
        let mut all = Vec::new();
        for krate in CRATES {
            let src = root.join(krate);
            assert!(src.is_dir(), "{} is missing", src.display());
            for (folder, circle) in circles(&src) {
                let at = if folder.is_empty() {
                    krate.to_string()
                } else {
                    format!("{krate}/{folder}")
                };
                all.push(format!("{at}: {}", circle.join(" <-> ")));
            }
        }
        assert!(all.is_empty(), "import circles:\n{}", all.join("\n"));
    }

    #[test]
    fn a_circle_between_two_siblings_is_found() {
        let dir = std::env::temp_dir().join(format!("xtask-layering-{}", std::process::id()));
        let src = dir.join("src");
        std::fs::create_dir_all(src.join("a")).unwrap();
        std::fs::write(src.join("lib.rs"), "mod a;\nmod c;\n").unwrap();
        std::fs::write(src.join("a/mod.rs"), "mod x;\nmod y;\n").unwrap();
        std::fs::write(src.join("a/x.rs"), "use super::y::Y;\npub struct X;\n").unwrap();
        // y reaches x inline and through a use tree; c is a test-only
        // importer that must not count.
        std::fs::write(
            src.join("a/y.rs"),
            "use crate::{c, a::{x::X}};\npub struct Y(X);\n",
        )
        .unwrap();
        std::fs::write(
            src.join("c.rs"),
            "// crate::a::y is named in a comment only\n#[cfg(test)]\nmod t { use crate::a; }\n",
        )
        .unwrap();
        let found = circles(&src);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(found, vec![("a".to_string(), vec!["x".into(), "y".into()])]);
    }
}
