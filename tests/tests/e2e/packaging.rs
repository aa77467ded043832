//! What the repository ships around the binary, kept true: docker-compose.yml
//! against the Compose Specification (there is no Docker engine to run it
//! here), its init SQL against what `outbox-relay setup` renders, and the relay
//! configuration it mounts.

use std::path::{Path, PathBuf};
use std::process::Command;

use outbox_relay::Config;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn the_compose_file_follows_the_compose_spec_and_everything_it_mounts_or_builds_exists() {
    let out = Command::new("python3")
        .arg("scripts/validate-compose.py")
        .current_dir(root())
        .output()
        .expect("python3 (scripts/install-deps.sh installs it with pyyaml and jsonschema)");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_compose_init_sql_is_what_setup_renders_for_the_compose_config() {
    let config = Config::load(&root().join("deploy/compose/relay.toml"))
        .unwrap_or_else(|e| panic!("deploy/compose/relay.toml: {e}"));
    let rendered =
        outbox_relay::setup::render(&config, "outbox_relay", false).expect("render setup SQL");
    let initdb = root().join("deploy/compose/initdb");
    for (file, sql) in &rendered {
        let shipped = std::fs::read_to_string(initdb.join(file))
            .unwrap_or_else(|e| panic!("deploy/compose/initdb/{file}: {e}"));
        // A comment block saying what the file is, a blank line, the rendering.
        let (_, body) = shipped
            .split_once("\n\n")
            .unwrap_or_else(|| panic!("deploy/compose/initdb/{file} has no header block"));
        assert_eq!(
            body.trim(),
            sql.trim(),
            "deploy/compose/initdb/{file} differs from `outbox-relay --config deploy/compose/relay.toml setup`"
        );
    }
    // Anything else there is the demo's own, and says so.
    for entry in std::fs::read_dir(&initdb).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if !rendered.iter().any(|(file, _)| *file == name) {
            let text = std::fs::read_to_string(initdb.join(&name)).unwrap();
            assert!(
                text.starts_with("-- Not `outbox-relay setup` output"),
                "deploy/compose/initdb/{name} is neither a rendering nor marked as the demo's own"
            );
        }
    }
}
