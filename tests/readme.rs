//! The README's library example is `examples/embed.rs` (which `cargo test`
//! compiles): the lines between its `README:BEGIN` and `README:END`
//! markers must appear in the README verbatim (less the indentation), so
//! the README never shows code that does not build.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

fn read(rel: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap()
}

#[test]
fn readme_library_example_is_examples_embed() {
    let example = read("examples/embed.rs");
    let begin = example.find("// README:BEGIN\n").expect("BEGIN marker") + 16;
    let end = example.find("    // README:END").expect("END marker");
    let body: Vec<&str> = example[begin..end]
        .lines()
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect();
    assert!(body.len() > 20, "{body:?}");
    let snippet = body.join("\n");
    let readme = read("README.md");
    assert!(
        readme.contains(&snippet),
        "README.md does not contain the body of examples/embed.rs verbatim:\n{snippet}"
    );
}
