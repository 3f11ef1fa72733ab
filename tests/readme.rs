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

/// The README's model section documents the one list of harmless
/// `config.json` keys (`HARMLESS_KEYS`), every key of it.
#[test]
fn readme_lists_every_harmless_model_key() {
    let readme = read("README.md");
    let start = readme.find("\n## Models\n").expect("a Models section");
    let section = &readme[start..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |e| e + 1)];
    for key in tierzero::model::config::HARMLESS_KEYS {
        assert!(
            section.contains(&format!("`{key}`")),
            "README's Models section does not list the harmless key `{key}`"
        );
    }
}
