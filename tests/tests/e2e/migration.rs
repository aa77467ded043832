//! `setup --apply` on an outbox table from before the derived lifecycle:
//! the column and its indexes are added online (no rewrite, old rows keep
//! their explicit state, new rows get their top-level transaction id), the
//! old poller index is dropped, running it again changes nothing, and a
//! PENDING row from before still reaches the destination.

use std::collections::HashMap;
use std::time::Duration;

use harness::{wait_until, RelayProcess};

use crate::outbox::{Collect, Outbox, Running};

/// The outbox table as `setup` created it before the derived lifecycle
/// (sql/001_outbox_table.sql at b52e47e, rendered for `public.outbox`);
/// scripts/migration-lock.sh starts from the same file.
pub const OLD_TABLE: &str = include_str!("../../data/outbox_before_derive.sql");

/// The partitioned variant before the derived lifecycle
/// (sql/001_outbox_table_partitioned.sql at b52e47e), with a partition
/// holding today besides the default one.
const OLD_PARTITIONED_TABLE: &str = include_str!("../../data/outbox_before_derive_partitioned.sql");

/// Put `outbox` back to the shape `setup` gave it before the derived
/// lifecycle: `table` (one of [`OLD_TABLE`], or the partitioned one) in the
/// publication with the old grants, and the position table without the
/// derived columns.
pub async fn old_shape(outbox: &Outbox, table: &str) {
    outbox
        .sql
        .batch_execute(&format!(
            "DROP TABLE outbox CASCADE;
             {table}
             ALTER PUBLICATION outbox_relay ADD TABLE outbox;
             GRANT SELECT, UPDATE, DELETE ON outbox TO {role};
             ALTER TABLE outbox_position DROP COLUMN snapshot, DROP COLUMN snapshot_lsn,
                 DROP COLUMN snapshot_at, DROP COLUMN hole_from, DROP COLUMN hole_to;",
            role = outbox.role
        ))
        .await
        .expect("the outbox table from before the derived lifecycle");
}

/// Run `outbox-relay setup --apply` as the table's owner, as an operator
/// would, with `args` besides; it must succeed. Its stderr.
pub async fn setup_apply(outbox: &Outbox, args: &[&str]) -> String {
    let config = outbox.owner_config_file("");
    let mut all = vec!["setup", "--apply", "--config", config.to_str().unwrap()];
    all.extend_from_slice(args);
    let mut setup = RelayProcess::spawn(&all, &[]);
    let status = setup
        .wait_exit_async(Duration::from_secs(60))
        .await
        .expect("setup --apply finishes");
    assert!(status.success(), "setup --apply: {}", setup.stderr_text());
    setup.stderr_text()
}

/// Each table of the outbox (the table, or each partition) and its file
/// node: a rewrite would give it a new one.
async fn filenodes(outbox: &Outbox) -> HashMap<String, u32> {
    outbox
        .sql
        .query(
            "SELECT c.relname::text, c.relfilenode FROM pg_class c \
             WHERE c.relname LIKE 'outbox%' AND c.relkind = 'r' \
               AND c.relnamespace = 'public'::regnamespace",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// The indexes of the outbox table and its partitions: name → valid.
async fn indexes(outbox: &Outbox) -> HashMap<String, bool> {
    outbox
        .sql
        .query(
            "SELECT c.relname::text, i.indisvalid FROM pg_index i \
             JOIN pg_class c ON c.oid = i.indexrelid \
             WHERE i.indrelid = 'outbox'::regclass \
                OR i.indrelid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'outbox'::regclass)",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Each row's `(publish_state, relay_txid, state from the view)`.
async fn rows(outbox: &Outbox) -> HashMap<String, (String, Option<String>, String)> {
    outbox
        .sql
        .query(
            "SELECT id::text, publish_state, relay_txid::text, state FROM outbox_state",
            &[],
        )
        .await
        .expect("the state view")
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3))))
        .collect()
}

/// Rows in each explicit state the lifecycle had before: PENDING ones,
/// PUBLISHED ones (with published_at) and a FAILED one.
async fn old_rows(outbox: &Outbox) -> (Vec<String>, Vec<String>, String) {
    let pending = outbox
        .insert_tx(&[("a".into(), "Old".into()), ("b".into(), "Old".into())])
        .await;
    let published = outbox
        .insert_tx(&[("c".into(), "Old".into()), ("d".into(), "Old".into())])
        .await;
    let failed = outbox.insert_tx(&[("e".into(), "Old".into())]).await;
    outbox
        .sql
        .execute(
            "UPDATE outbox SET publish_state = 'PUBLISHED', published_at = now() \
             WHERE id = ANY($1::text[]::uuid[])",
            &[&published],
        )
        .await
        .unwrap();
    outbox
        .sql
        .execute(
            "UPDATE outbox SET publish_state = 'FAILED', attempts = 1, last_error = 'x' \
             WHERE id = $1::text::uuid",
            &[&failed[0]],
        )
        .await
        .unwrap();
    (pending, published, failed[0].clone())
}

/// A row inserted inside a savepoint: `(relay_txid, xmin, the top-level id)`.
async fn insert_in_savepoint(outbox: &Outbox) -> (String, String, String) {
    let client = outbox.db.client().await;
    client.batch_execute("BEGIN; SAVEPOINT s").await.unwrap();
    // (A partitioned table's INSERT cannot return xmin: read it back.)
    let id: String = client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'n', 'New', '{}') RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let row = client
        .query_one(
            "SELECT relay_txid::text, xmin::text FROM outbox WHERE id = $1::text::uuid",
            &[&id],
        )
        .await
        .unwrap();
    client.batch_execute("RELEASE SAVEPOINT s").await.unwrap();
    let top: String = client
        .query_one("SELECT pg_current_xact_id()::text", &[])
        .await
        .unwrap()
        .get(0);
    client.batch_execute("COMMIT").await.unwrap();
    (row.get(0), row.get(1), top)
}

/// What the migration must leave, on a plain or a partitioned table.
async fn migrated_online(partitioned: bool) {
    let outbox = Outbox::new().await;
    old_shape(
        &outbox,
        if partitioned {
            OLD_PARTITIONED_TABLE
        } else {
            OLD_TABLE
        },
    )
    .await;
    let (pending, published, failed) = old_rows(&outbox).await;
    if partitioned {
        // A row in the default partition too.
        outbox
            .sql
            .batch_execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at) \
                 VALUES ('order', 'f', 'Old', '{}', now() + interval '1 year')",
            )
            .await
            .unwrap();
    }
    let before = filenodes(&outbox).await;
    assert!(indexes(&outbox).await.contains_key("outbox_due_idx"));

    setup_apply(&outbox, &[]).await;

    // No rewrite: the table (each partition) is the same file.
    assert_eq!(filenodes(&outbox).await, before);
    // The default, for new rows only.
    let default: String = outbox
        .sql
        .query_one(
            "SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d JOIN pg_attribute a \
               ON a.attrelid = d.adrelid AND a.attnum = d.adnum \
             WHERE d.adrelid = 'outbox'::regclass AND a.attname = 'relay_txid'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(default, "pg_current_xact_id()");
    // Every index valid, on every partition; the old poller index gone.
    let indexes = indexes(&outbox).await;
    for wanted in [
        "outbox_txid_idx",
        "outbox_explicit_idx",
        "outbox_published_idx",
    ] {
        assert_eq!(indexes.get(wanted), Some(&true), "{wanted}: {indexes:?}");
    }
    if partitioned {
        for part in ["outbox_today", "outbox_default"] {
            for suffix in ["_txid_idx", "_explicit_idx"] {
                let name = format!("{part}{suffix}");
                assert_eq!(indexes.get(&name), Some(&true), "{name}: {indexes:?}");
            }
        }
    }
    // (On partitions, the old index's children are named after its column.)
    assert!(
        !indexes
            .keys()
            .any(|i| i.contains("due_idx") || i.ends_with("_created_at_idx")),
        "{indexes:?}"
    );
    // Old rows carry no id and keep their explicit states, read as such.
    let states = rows(&outbox).await;
    for id in &pending {
        assert_eq!(
            states[id],
            ("PENDING".into(), None, "PENDING".into()),
            "{id}"
        );
    }
    for id in &published {
        assert_eq!(
            states[id],
            ("PUBLISHED".into(), None, "PUBLISHED".into()),
            "{id}"
        );
    }
    assert_eq!(states[&failed], ("FAILED".into(), None, "FAILED".into()));
    assert_eq!(
        states
            .values()
            .filter(|(_, txid, _)| txid.is_some())
            .count(),
        0
    );
    // A new row gets its transaction's top-level id, also from a savepoint
    // (where xmin names the subtransaction).
    let (txid, xmin, top) = insert_in_savepoint(&outbox).await;
    assert_eq!(txid, top);
    assert_ne!(xmin, top, "the row was written by a subtransaction");
    let plain = outbox.insert_tx(&[("g".into(), "New".into())]).await;
    let states = rows(&outbox).await;
    let (state, id, view) = &states[&plain[0]];
    assert_eq!((state.as_str(), view.as_str()), ("PENDING", "PENDING"));
    assert!(id.is_some());

    // Again: nothing changes.
    let before = (filenodes(&outbox).await, indexes_oids(&outbox).await);
    setup_apply(&outbox, &[]).await;
    assert_eq!(
        (filenodes(&outbox).await, indexes_oids(&outbox).await),
        before
    );
    assert_eq!(rows(&outbox).await, states);
}

/// Each index of the outbox and its oid: one built again would have another.
async fn indexes_oids(outbox: &Outbox) -> HashMap<String, u32> {
    outbox
        .sql
        .query(
            "SELECT c.relname::text, c.oid FROM pg_class c \
             WHERE c.relname LIKE 'outbox%' AND c.relkind IN ('i', 'I')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_from_before_the_derived_lifecycle_is_migrated_online_and_keeps_its_states() {
    migrated_online(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_table_from_before_the_derived_lifecycle_is_migrated_partition_by_partition()
{
    migrated_online(true).await;
}

/// The migration waits for its lock at most `lock_timeout`: behind a long
/// transaction it gives up, changes nothing and names the transaction; once
/// that one is done, the same command finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migration_gives_up_behind_a_long_transaction_and_names_it() {
    let outbox = Outbox::new().await;
    old_shape(&outbox, OLD_TABLE).await;
    let long = outbox.db.client().await;
    long.batch_execute("BEGIN; SELECT count(*) FROM outbox")
        .await
        .unwrap();
    let config = outbox.owner_config_file("");
    let mut setup = RelayProcess::spawn(
        &["setup", "--apply", "--config", config.to_str().unwrap()],
        &[],
    );
    let status = setup
        .wait_exit_async(Duration::from_secs(60))
        .await
        .expect("setup --apply gives up");
    let stderr = setup.stderr_text();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("007_derived_column.sql failed")
            && stderr.contains("nothing was changed")
            && stderr.contains("AccessShareLock")
            && stderr.contains("run setup --apply again"),
        "{stderr}"
    );
    let added: bool = outbox
        .sql
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'outbox'::regclass \
             AND attname = 'relay_txid')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!added);
    long.batch_execute("COMMIT").await.unwrap();
    setup_apply(&outbox, &[]).await;
}

/// A poller that polls often, with a grace longer than the derived
/// lifecycle takes to vouch for a delivered row (a candidate a second, stored
/// once the stream passed it): with a grace shorter than that, the poller
/// takes rows the stream delivered and no pair vouches for yet, and sends
/// them again (docs/guarantees.md, the derived lifecycle's limits).
const FAST_POLLER: &str = "[poller]\ninterval = \"200ms\"\ngrace = \"10s\"\n";

/// The demand: a PENDING row written before the migration carries no
/// id, so it is never derived published; the relay publishes it after the
/// migration and marks it PUBLISHED explicitly. Rows written after it are
/// derived published, never updated. (Needs the stream side of the derived
/// lifecycle.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_row_from_before_the_migration_reaches_the_destination_and_ends_published() {
    let outbox = Outbox::new().await;
    old_shape(&outbox, OLD_TABLE).await;
    let before = outbox
        .insert_tx(&[("a".into(), "Old".into()), ("b".into(), "Old".into())])
        .await;
    setup_apply(&outbox, &[]).await;

    let sink = Collect::default();
    let relay = Running::start(outbox.config(FAST_POLLER), sink.clone());
    outbox.wait_slot_active(true).await;
    wait_until(
        Duration::from_secs(30),
        "the old rows are delivered and marked PUBLISHED",
        || async {
            let delivered = sink.ids();
            let states = rows(&outbox).await;
            before.iter().all(|id| {
                delivered.contains(id)
                    && states[id] == ("PUBLISHED".into(), None, "PUBLISHED".into())
            })
        },
    )
    .await;
    let after = outbox.insert_tx(&[("c".into(), "New".into())]).await;
    wait_until(
        Duration::from_secs(30),
        "the new row is delivered and derived published",
        || async {
            let states = rows(&outbox).await;
            sink.ids().contains(&after[0]) && {
                let (state, txid, view) = &states[&after[0]];
                state == "PENDING" && txid.is_some() && view == "PUBLISHED"
            }
        },
    )
    .await;
    relay.stop().await;
    let delivered = sink.ids();
    for id in before.iter().chain(&after) {
        assert_eq!(
            delivered.iter().filter(|d| *d == id).count(),
            1,
            "{id} delivered once"
        );
    }
}
