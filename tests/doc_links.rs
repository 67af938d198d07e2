//! Every relative link in the repository's Markdown resolves.
//!
//! The README is short and points into `docs/`, and the pages there point back into the tree
//! (fixtures, examples, scripts) and at each other's sections. Moving a section or renaming a
//! file breaks such links silently: nothing builds them, and a reader finds out on click. So
//! this test walks every `*.md` file (skipping build outputs, `.git` and virtual
//! environments), takes each Markdown link and image `[text](dest)` / `![alt](dest)` outside
//! fenced code blocks and inline code, and checks that
//!
//! - a relative destination exists, resolved against the Markdown file's directory (a leading
//!   `/` against the repository root, as GitHub does), and
//! - a `#fragment` into a Markdown file (or a bare `#fragment` into the same file) is the
//!   GitHub anchor of one of its headings.
//!
//! Absolute URLs (`scheme://...`, `mailto:`) are not fetched. Headings are ATX headings
//! (`## Title`), the only kind the repository writes. The checker reads files through the
//! small [`Tree`] trait, so the unit test below runs it on in-memory strings.

use std::collections::HashMap;
use std::fs;
use std::path::{Component, Path, PathBuf};

/// Directories never searched for Markdown: build outputs, version control, the GPU build
/// (`.gpu/`) and Python environments and caches, whose files are not the repository's docs.
const SKIPPED_DIRS: &[&str] = &[
    "target",
    ".git",
    ".gpu",
    "node_modules",
    ".venv",
    "venv",
    ".pytest_cache",
];

/// What the checker needs from a file tree. Paths are relative to the tree's root and
/// lexically normalised (no `.` or `..`).
trait Tree {
    fn exists(&self, path: &Path) -> bool;
    fn read(&self, path: &Path) -> Option<String>;
}

/// The repository on disk.
struct Disk {
    root: PathBuf,
}

impl Tree for Disk {
    fn exists(&self, path: &Path) -> bool {
        self.root.join(path).exists()
    }

    fn read(&self, path: &Path) -> Option<String> {
        fs::read_to_string(self.root.join(path)).ok()
    }
}

/// A tree of in-memory files; a directory exists when some file lies under it.
impl Tree for HashMap<PathBuf, String> {
    fn exists(&self, path: &Path) -> bool {
        self.keys().any(|file| file.starts_with(path))
    }

    fn read(&self, path: &Path) -> Option<String> {
        self.get(path).cloned()
    }
}

/// A link destination as written, and the 1-based line it is on.
struct Link {
    line: usize,
    dest: String,
}

/// Every Markdown `*.md` file under `root`, relative to it, sorted.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    fn walk(root: &Path, dir: &Path, found: &mut Vec<PathBuf>) {
        let entries = fs::read_dir(root.join(dir))
            .unwrap_or_else(|err| panic!("cannot list {}: {err}", root.join(dir).display()));
        for entry in entries {
            let entry = entry.expect("a directory entry");
            let name = entry.file_name();
            let path = dir.join(&name);
            // file_type does not follow symbolic links, so a link cycle cannot trap the walk.
            let file_type = entry.file_type().expect("a file type");
            if file_type.is_dir() {
                if !SKIPPED_DIRS.iter().any(|skipped| name == *skipped) {
                    walk(root, &path, found);
                }
            } else if path.extension().is_some_and(|ext| ext == "md") {
                found.push(path);
            }
        }
    }
    let mut found = Vec::new();
    walk(root, Path::new(""), &mut found);
    found.sort();
    found
}

/// The fence that opens or closes a fenced code block on this line: its character and length.
fn fence(line: &str) -> Option<(char, usize)> {
    let trimmed = line.trim_start();
    let marker = trimmed.chars().next().filter(|c| *c == '`' || *c == '~')?;
    let length = trimmed.chars().take_while(|c| *c == marker).count();
    (length >= 3).then_some((marker, length))
}

/// Lines outside fenced code blocks, with their 1-based numbers.
fn prose_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let mut open: Option<(char, usize)> = None;
    text.lines().enumerate().filter_map(move |(index, line)| {
        match (open, fence(line)) {
            (None, Some(opening)) => open = Some(opening),
            (Some((marker, length)), Some((found, found_length)))
                if found == marker && found_length >= length =>
            {
                open = None
            }
            (None, None) => return Some((index + 1, line)),
            _ => {}
        }
        None
    })
}

/// The paragraphs outside code blocks (runs of consecutive prose lines), each with the number
/// of its first line. Inline code and links may wrap across lines, never across paragraphs.
fn paragraphs(text: &str) -> Vec<(usize, String)> {
    let mut found: Vec<(usize, String)> = Vec::new();
    let mut previous = 0;
    for (line, content) in prose_lines(text) {
        match found.last_mut() {
            Some((_, paragraph)) if line == previous + 1 && !content.trim().is_empty() => {
                paragraph.push('\n');
                paragraph.push_str(content);
            }
            _ if content.trim().is_empty() => {}
            _ => found.push((line, content.to_string())),
        }
        previous = if content.trim().is_empty() { 0 } else { line };
    }
    found
}

/// The text with every inline code span (a run of backticks up to the next run of the same
/// length) blanked, line breaks kept, so that nothing inside one looks like a link.
fn blank_inline_code(text: &str) -> Vec<char> {
    let mut chars: Vec<char> = text.chars().collect();
    let run_at = |chars: &[char], at: usize| chars[at..].iter().take_while(|c| **c == '`').count();
    let mut at = 0;
    while at < chars.len() {
        if chars[at] != '`' {
            at += 1;
            continue;
        }
        let opening = run_at(&chars, at);
        let mut close = at + opening;
        let closing = loop {
            if close >= chars.len() {
                break None;
            }
            if chars[close] == '`' {
                let run = run_at(&chars, close);
                if run == opening {
                    break Some(close + run);
                }
                close += run;
            } else {
                close += 1;
            }
        };
        match closing {
            Some(end) => {
                chars[at..end]
                    .iter_mut()
                    .filter(|c| **c != '\n')
                    .for_each(|c| *c = ' ');
                at = end;
            }
            // An unmatched run of backticks is literal text.
            None => at += opening,
        }
    }
    chars
}

/// The destination of an inline link whose `(` is at `open`: `<dest>` or a run without
/// spaces and with balanced parentheses; a title after it is ignored.
fn destination(chars: &[char], open: usize) -> Option<String> {
    let mut at = open + 1;
    while chars.get(at) == Some(&' ') {
        at += 1;
    }
    if chars.get(at) == Some(&'<') {
        let end = at + 1 + chars[at + 1..].iter().position(|c| *c == '>')?;
        return Some(chars[at + 1..end].iter().collect());
    }
    let start = at;
    let mut depth = 0;
    while let Some(&c) = chars.get(at) {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => break,
            ')' => depth -= 1,
            c if c.is_whitespace() => break,
            _ => {}
        }
        at += 1;
    }
    // Running off the end means the `(` was never closed: not a link.
    (at < chars.len()).then(|| chars[start..at].iter().collect())
}

/// The inline links and images of a Markdown text, outside code.
fn links(text: &str) -> Vec<Link> {
    let mut found = Vec::new();
    for (first_line, paragraph) in paragraphs(text) {
        let chars = blank_inline_code(&paragraph);
        let line_of = |at: usize| first_line + chars[..at].iter().filter(|c| **c == '\n').count();
        let mut at = 0;
        while at < chars.len() {
            if chars[at] != '[' || (at > 0 && chars[at - 1] == '\\') {
                at += 1;
                continue;
            }
            // The matching `]`, allowing nested brackets in the text.
            let mut depth = 0;
            let mut close = None;
            for (offset, c) in chars[at..].iter().enumerate() {
                match c {
                    '[' => depth += 1,
                    ']' => {
                        depth -= 1;
                        if depth == 0 {
                            close = Some(at + offset);
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let link = close
                .filter(|close| chars.get(close + 1) == Some(&'('))
                .and_then(|close| Some((close, destination(&chars, close + 1)?)));
            match link {
                Some((close, dest)) => {
                    found.push(Link {
                        line: line_of(at),
                        dest,
                    });
                    at = close + 1;
                }
                // An unclosed `[`, or `[text]` without a destination: links may still lie
                // inside it (an image in a link's text, for example).
                None => at += 1,
            }
        }
    }
    found
}

/// GitHub's anchor for a heading's text: lowercase, keep alphanumerics, spaces, hyphens and
/// underscores, spaces become hyphens. A link in the heading counts by its text.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let chars: Vec<char> = heading.chars().collect();
    let mut at = 0;
    while at < chars.len() {
        // `[text](dest)` renders as `text`.
        if chars[at] == ']' && chars.get(at + 1) == Some(&'(') {
            if let Some(close) = chars[at..].iter().position(|c| *c == ')') {
                at += close + 1;
                continue;
            }
        }
        text.push(chars[at]);
        at += 1;
    }
    text.to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown text's ATX headings, a repeated one numbered as GitHub does
/// (`name`, `name-1`, `name-2`, ...).
fn anchors(text: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut found = Vec::new();
    for (_, line) in prose_lines(text) {
        let trimmed = line.trim_start_matches(' ');
        let level = trimmed.chars().take_while(|c| *c == '#').count();
        let rest = &trimmed[level..];
        let indent = line.len() - trimmed.len();
        if indent > 3
            || !(1..=6).contains(&level)
            || !(rest.is_empty() || rest.starts_with([' ', '\t']))
        {
            continue;
        }
        // A closing run of `#`s after a space is not part of the heading (`# C#` keeps its).
        let title = rest.trim();
        let unclosed = title.trim_end_matches('#');
        let title = if unclosed.is_empty() || unclosed.ends_with([' ', '\t']) {
            unclosed.trim_end()
        } else {
            title
        };
        let base = slug(title);
        let count = seen.entry(base.clone()).or_insert(0);
        found.push(if *count == 0 {
            base.clone()
        } else {
            format!("{base}-{count}")
        });
        *count += 1;
    }
    found
}

/// `scheme://...` or `mailto:...`: a link this test does not follow.
fn is_external(dest: &str) -> bool {
    if dest.starts_with("mailto:") {
        return true;
    }
    match dest.split_once("://") {
        Some((scheme, _)) => {
            scheme.starts_with(|c: char| c.is_ascii_alphabetic())
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        }
        None => false,
    }
}

/// `%XX` escapes decoded (a path with spaces is written `a%20b`); anything else kept.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let hex = bytes
            .get(at + 1..at + 3)
            .and_then(|pair| std::str::from_utf8(pair).ok())
            .and_then(|pair| u8::from_str_radix(pair, 16).ok());
        match (bytes[at], hex) {
            (b'%', Some(byte)) => {
                decoded.push(byte);
                at += 3;
            }
            (byte, _) => {
                decoded.push(byte);
                at += 1;
            }
        }
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

/// `path` with `.` and `..` resolved lexically; `None` when it climbs out of the root.
fn normalise(path: &Path) -> Option<PathBuf> {
    let mut parts: Vec<&std::ffi::OsStr> = Vec::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => parts.push(part),
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    Some(parts.iter().collect())
}

/// Why `dest`, written in the Markdown file `file`, does not resolve; `None` when it does.
fn broken(tree: &impl Tree, file: &Path, file_text: &str, dest: &str) -> Option<String> {
    if is_external(dest) {
        return None;
    }
    let (path, fragment) = match dest.split_once('#') {
        Some((path, fragment)) => (percent_decode(path), Some(percent_decode(fragment))),
        None => (percent_decode(dest), None),
    };
    let target = if path.is_empty() {
        file.to_path_buf()
    } else {
        let joined = match path.strip_prefix('/') {
            Some(from_root) => PathBuf::from(from_root),
            None => file.parent().unwrap_or(Path::new("")).join(&path),
        };
        match normalise(&joined) {
            Some(target) => target,
            None => return Some(format!("{path} leaves the repository")),
        }
    };
    if !tree.exists(&target) {
        return Some(format!("no such file: {}", target.display()));
    }
    let fragment = fragment.filter(|fragment| !fragment.is_empty())?;
    if target.extension().is_none_or(|ext| ext != "md") {
        return None;
    }
    let target_text = if target == file {
        Some(file_text.to_string())
    } else {
        tree.read(&target)
    };
    let Some(target_text) = target_text else {
        return Some(format!("cannot read {}", target.display()));
    };
    (!anchors(&target_text).contains(&fragment))
        .then(|| format!("no heading with anchor #{fragment} in {}", target.display()))
}

/// Every broken link of one Markdown file, as `file:line: link (reason)`.
fn check_file(tree: &impl Tree, file: &Path, text: &str) -> Vec<String> {
    links(text)
        .into_iter()
        .filter_map(|link| {
            broken(tree, file, text, &link.dest)
                .map(|reason| format!("{}:{}: {} ({reason})", file.display(), link.line, link.dest))
        })
        .collect()
}

#[test]
fn every_relative_link_and_anchor_in_the_markdown_resolves() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let files = markdown_files(&root);
    assert!(
        files.contains(&PathBuf::from("README.md")),
        "the walk found no README.md under {}: {files:?}",
        root.display()
    );
    let disk = Disk { root };
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = disk
            .read(file)
            .unwrap_or_else(|| panic!("cannot read {}", file.display()));
        checked += links(&text).len();
        problems.extend(check_file(&disk, file, &text));
    }
    assert!(
        problems.is_empty(),
        "{} broken link(s) among {checked} in {} Markdown files:\n{}",
        problems.len(),
        files.len(),
        problems.join("\n")
    );
}

#[test]
fn the_checker_reports_a_broken_path_and_a_broken_anchor() {
    let readme = "\
# Title

See [the guide](docs/guide.md#getting-started), ![a plot](docs/plot.svg) and [home](#title).
A [missing page](docs/missing.md) and a [missing section](docs/guide.md#no-such-section).
[Up and back](docs/../docs/guide.md#the-stronger-milp-solver-optional), [web](https://example.com/x.md).
`[in code](nowhere.md)` is code; so is this:

```md
[in a fence](nowhere.md)
```

[bad self](#nothing-here) and a `code span that
wraps` before a [link that
wraps](docs/gone.md).
";
    let guide = "\
# Guide

## Getting started

## The stronger MILP solver (optional)
";
    let tree: HashMap<PathBuf, String> = [
        ("README.md", readme),
        ("docs/guide.md", guide),
        ("docs/plot.svg", "<svg/>"),
    ]
    .into_iter()
    .map(|(path, text)| (PathBuf::from(path), text.to_string()))
    .collect();

    assert_eq!(
        check_file(&tree, Path::new("README.md"), readme),
        [
            "README.md:4: docs/missing.md (no such file: docs/missing.md)",
            "README.md:4: docs/guide.md#no-such-section \
             (no heading with anchor #no-such-section in docs/guide.md)",
            "README.md:12: #nothing-here (no heading with anchor #nothing-here in README.md)",
            "README.md:13: docs/gone.md (no such file: docs/gone.md)",
        ]
    );
    assert_eq!(
        check_file(&tree, Path::new("docs/guide.md"), guide),
        Vec::<String>::new()
    );
}

#[test]
fn anchors_follow_github() {
    assert_eq!(
        anchors(
            "# mucudnn\n## The stronger MILP solver (optional)\n### `tune --verify`\n\
             ## On GPUs\n## On GPUs ##\n# C#\n    # indented code\n#hashtag\n"
        ),
        [
            "mucudnn",
            "the-stronger-milp-solver-optional",
            "tune---verify",
            "on-gpus",
            "on-gpus-1",
            "c",
        ]
    );
    assert_eq!(
        slug("See [the cache](cli.md#the-tuning-cache) here"),
        "see-the-cache-here"
    );
}
