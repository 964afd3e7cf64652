//! The docs as a reader meets them: every relative link in the repository's Markdown (README.md, docs/,
//! BENCHMARKS.md, the READMEs beside deploy/ and e2e/) opens a file of this repository, and every `#anchor`
//! names a heading of the page it points to, as GitHub renders it. Also keeps the project's rule that docs
//! and code state a rule or a reason, never a number of the project's issue tracker.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::sync::LazyLock;

use regex::Regex;

/// `[text](target)`, for a heading's rendered text.
static LINK: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\[([^\]]*)\]\([^)]*\)").unwrap());
static TAG: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"<[^>]+>").unwrap());
static HEADING: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^#{1,6}\s+(.*?)\s*#*\s*$").unwrap());
static EXPLICIT_ANCHOR: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r#"<a\s+(?:id|name)="([^"]+)""#).unwrap());
static CODE_SPAN: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"`[^`]*`").unwrap());
/// An inline link's or image's target: `](target)` or `](target "title")`.
static INLINE_TARGET: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r#"\]\(\s*<?([^)\s>]*)>?(?:\s+"[^"]*")?\s*\)"#).unwrap());
/// A reference definition: `[name]: target`.
static DEFINITION: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)").unwrap());
static SCHEME: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[a-zA-Z][a-zA-Z0-9+.-]*:").unwrap());

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Files under `dir` (relative to the root) whose name ends with one of `suffixes`, skipping build output,
/// git's files and vendored test inputs.
fn files(dir: &Path, suffixes: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(root().join(dir)) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = dir.join(&name);
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            if !["target", ".git", "node_modules"].contains(&name.as_str()) {
                files(&path, suffixes, out);
            }
        } else if suffixes.iter().any(|suffix| name.ends_with(suffix)) {
            out.push(path);
        }
    }
}

fn markdown_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    files(Path::new(""), &[".md"], &mut out);
    out.sort();
    out
}

/// The lines of a Markdown text outside fenced code blocks, with their line numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// The anchor GitHub gives a heading: the rendered text lower-cased, everything but letters, digits,
/// spaces, hyphens and underscores dropped, spaces made hyphens.
fn slug(heading: &str) -> String {
    let text = LINK.replace_all(heading, "$1");
    let text = TAG.replace_all(&text, "");
    text.trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor of a Markdown page: its headings' (a repeated one gets `-1`, `-2`, ... as GitHub numbers
/// them) and explicit `<a id|name="...">`s.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        if let Some(found) = HEADING.captures(line) {
            let base = slug(&found[1]);
            let count = seen.entry(base.clone()).or_insert(0);
            out.insert(match *count {
                0 => base.clone(),
                n => format!("{base}-{n}"),
            });
            *count += 1;
        }
        for found in EXPLICIT_ANCHOR.captures_iter(line) {
            out.insert(found[1].to_string());
        }
    }
    out
}

/// The link targets of a Markdown page, with their line numbers: inline links and images and reference
/// definitions, outside code blocks and code spans.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (number, line) in prose_lines(text) {
        let line = CODE_SPAN.replace_all(line, "");
        for found in INLINE_TARGET.captures_iter(&line) {
            out.push((number, found[1].to_string()));
        }
        if let Some(found) = DEFINITION.captures(&line) {
            out.push((number, found[1].to_string()));
        }
    }
    out
}

/// `path` with `.` and `..` resolved, or None when it climbs above the repository.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::Normal(name) => out.push(name),
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// Why the link `target` of the page `page` does not resolve, or None when it does.
fn broken(page: &Path, target: &str) -> Option<String> {
    if target.is_empty() {
        return Some("an empty link".into());
    }
    if SCHEME.is_match(target) {
        return None; // http(s), mailto: not a file of ours
    }
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (target, None),
    };
    let path = path.split('?').next().unwrap_or_default();
    let file = if path.is_empty() {
        page.to_path_buf()
    } else if let Some(absolute) = path.strip_prefix('/') {
        PathBuf::from(absolute)
    } else {
        match normalize(&page.parent().unwrap_or(Path::new("")).join(path)) {
            Some(file) => file,
            None => {
                return Some(format!(
                    "{path} is outside the repository (a clone has nothing there)"
                ))
            }
        }
    };
    let full = root().join(&file);
    if !full.exists() {
        return Some(format!("{} does not exist", file.display()));
    }
    let anchor = anchor?;
    if full.extension().is_none_or(|ext| ext != "md") {
        return None; // a line anchor of a source file, which GitHub resolves in its viewer
    }
    let text = std::fs::read_to_string(&full).ok()?;
    if anchors(&text).contains(anchor) {
        None
    } else {
        Some(format!("{} has no heading #{anchor}", file.display()))
    }
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let pages = markdown_files();
    assert!(
        pages.contains(&PathBuf::from("README.md")),
        "no README.md found under {}",
        root().display()
    );
    let mut problems = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(root().join(page)).unwrap();
        for (line, target) in links(&text) {
            if let Some(why) = broken(page, &target) {
                problems.push(format!("{}:{line}: ({target}): {why}", page.display()));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} broken links:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn the_link_checker_finds_what_a_reader_would_trip_on() {
    let page = Path::new("docs/x.md");
    assert_eq!(broken(page, "../README.md"), None);
    assert_eq!(broken(page, "https://kubernetes.io/docs/"), None);
    assert_eq!(broken(Path::new("README.md"), "Cargo.toml"), None);
    assert!(broken(page, "README.md")
        .unwrap()
        .contains("docs/README.md does not exist"));
    assert!(broken(page, "../../shared/DESIGN.md")
        .unwrap()
        .contains("outside the repository"));
    assert!(broken(page, "../README.md#no-such-heading")
        .unwrap()
        .contains("has no heading #no-such-heading"));

    let text = "# Why is my pod Pending? `gpu-dra explain`\n\n## Day two\n## Day two\n\
                ```sh\n# not a heading [x](nowhere.md)\n```\n\
                ## [Linked](x.md) *heading*, with: punctuation!\n<a id=\"kept\"></a>\n";
    let found = anchors(text);
    for anchor in [
        "why-is-my-pod-pending-gpu-dra-explain",
        "day-two",
        "day-two-1",
        "linked-heading-with-punctuation",
        "kept",
    ] {
        assert!(found.contains(anchor), "{anchor} not in {found:?}");
    }
    assert!(!found.contains("not-a-heading"), "{found:?}");
    assert_eq!(
        links("see [a](a.md#b), `[code](no.md)` and ![img](i.svg \"title\")\n[ref]: r.md\n"),
        vec![
            (1, "a.md#b".to_string()),
            (1, "i.svg".to_string()),
            (2, "r.md".to_string())
        ]
    );
}

/// Source and doc files where a reader would meet a number of the project's issue tracker.
fn text_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in [
        "src", "tests", "benches", "e2e", "deploy", "tools", "docs", "examples", "proto", ".ci",
    ] {
        files(
            Path::new(dir),
            &[
                ".rs", ".md", ".sh", ".py", ".yaml", ".yml", ".proto", ".tpl", ".txt", "run",
            ],
            &mut out,
        );
    }
    for file in [
        "README.md",
        "BENCHMARKS.md",
        "Cargo.toml",
        "build.rs",
        "Dockerfile",
    ] {
        out.push(PathBuf::from(file));
    }
    out
}

#[test]
fn docs_and_code_state_the_reason_not_an_issue_number() {
    // Spelt in two parts so that this file does not match itself.
    let pattern = format!(r"(?i)\b{}s? #?\d+\b", "issue");
    let issue_number = Regex::new(&pattern).unwrap();
    let mut found = Vec::new();
    for file in text_files() {
        let Ok(text) = std::fs::read_to_string(root().join(&file)) else {
            continue;
        };
        for (i, line) in text.lines().enumerate() {
            if let Some(hit) = issue_number.find(line) {
                found.push(format!("{}:{}: {}", file.display(), i + 1, hit.as_str()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "say what the rule or the reason is instead of the issue number:\n{}",
        found.join("\n")
    );
}
