//! A transaction as PostgreSQL 15's pgoutput (proto_version '1', text
//! format) sends it for
//!
//! ```sql
//! CREATE TABLE public.outbox (id uuid PRIMARY KEY, topic text NOT NULL, payload jsonb NOT NULL);
//! INSERT INTO outbox VALUES ('0b6e2a3c-5d41-4f6e-9a57-2c1d8e4f7a90', 'order.created',
//!                            '{"id": 42, "total": 99.5, "currency": "EUR"}');
//! ```
//!
//! Hand-assembled field by field from the documented message formats.

use bytes::Bytes;

use crate::{decode, BeginPrepare, CommitPrepared, Message, Prepare, RollbackPrepared, Value};

/// The table's OID.
const OUTBOX: [u8; 4] = [0x00, 0x00, 0x40, 0x01]; // 16385

fn assemble(parts: &[&[u8]]) -> Bytes {
    Bytes::from(parts.concat())
}

fn begin() -> Bytes {
    assemble(&[
        b"B",
        &[0x00, 0x00, 0x00, 0x01, 0x6B, 0x37, 0x8F, 0x10], // final LSN 1/6B378F10
        &[0x00, 0x02, 0xBA, 0x4C, 0x2C, 0x8A, 0x40, 0x00], // commit time
        &[0x00, 0x00, 0x02, 0xF3],                         // xid 755
    ])
}

fn relation() -> Bytes {
    assemble(&[
        b"R",
        &OUTBOX,
        b"public\0",
        b"outbox\0",
        b"d", // replica identity default (primary key)
        &[0x00, 0x03],
        // id uuid, part of the key
        &[0x01],
        b"id\0",
        &[0x00, 0x00, 0x0B, 0x86], // 2950 uuid
        &[0xFF, 0xFF, 0xFF, 0xFF],
        // topic text
        &[0x00],
        b"topic\0",
        &[0x00, 0x00, 0x00, 0x19], // 25 text
        &[0xFF, 0xFF, 0xFF, 0xFF],
        // payload jsonb
        &[0x00],
        b"payload\0",
        &[0x00, 0x00, 0x0E, 0xDA], // 3802 jsonb
        &[0xFF, 0xFF, 0xFF, 0xFF],
    ])
}

fn insert() -> Bytes {
    assemble(&[
        b"I",
        &OUTBOX,
        b"N",
        &[0x00, 0x03],
        b"t",
        &[0x00, 0x00, 0x00, 0x24],
        b"0b6e2a3c-5d41-4f6e-9a57-2c1d8e4f7a90",
        b"t",
        &[0x00, 0x00, 0x00, 0x0D],
        b"order.created",
        b"t",
        &[0x00, 0x00, 0x00, 0x2C],
        br#"{"id": 42, "total": 99.5, "currency": "EUR"}"#,
    ])
}

fn commit() -> Bytes {
    assemble(&[
        b"C",
        &[0x00],                                           // flags
        &[0x00, 0x00, 0x00, 0x01, 0x6B, 0x37, 0x8F, 0x10], // commit LSN
        &[0x00, 0x00, 0x00, 0x01, 0x6B, 0x37, 0x8F, 0x40], // end LSN
        &[0x00, 0x02, 0xBA, 0x4C, 0x2C, 0x8A, 0x40, 0x00], // commit time
    ])
}

#[test]
fn captured_transaction_decodes() {
    let Ok(Message::Begin(b)) = decode(begin()) else {
        panic!("begin");
    };
    assert_eq!(b.final_lsn, 0x1_6B37_8F10);
    assert_eq!(b.xid, 755);

    let Ok(Message::Relation(rel)) = decode(relation()) else {
        panic!("relation");
    };
    assert_eq!((rel.oid, rel.namespace.as_str()), (16385, "public"));
    assert_eq!(rel.name, "outbox");
    let names: Vec<&str> = rel.columns.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["id", "topic", "payload"]);
    let types: Vec<u32> = rel.columns.iter().map(|c| c.type_oid).collect();
    assert_eq!(types, [2950, 25, 3802]);
    assert!(rel.columns[0].is_key() && !rel.columns[1].is_key());

    let Ok(Message::Insert(ins)) = decode(insert()) else {
        panic!("insert");
    };
    assert_eq!(ins.relation_oid, rel.oid);
    assert_eq!(ins.tuple.len(), rel.columns.len());
    let text = |s: &'static str| Some(Value::Text(Bytes::from_static(s.as_bytes())));
    assert_eq!(
        ins.tuple.get(0),
        text("0b6e2a3c-5d41-4f6e-9a57-2c1d8e4f7a90")
    );
    assert_eq!(ins.tuple.get(1), text("order.created"));
    assert_eq!(
        ins.tuple.get(2),
        text(r#"{"id": 42, "total": 99.5, "currency": "EUR"}"#)
    );

    let Ok(Message::Commit(c)) = decode(commit()) else {
        panic!("commit");
    };
    assert_eq!(c.commit_lsn, b.final_lsn);
    assert_eq!(c.end_lsn, 0x1_6B37_8F40);
    assert_eq!(c.commit_time, b.commit_time);
}

/// Messages PostgreSQL 15.x sent, captured with
/// `pg_logical_slot_peek_binary_changes(slot, NULL, NULL, 'proto_version', '3',
/// 'publication_names', 'p', 'two_phase', 'on')` on a slot created with
/// `two_phase`, for
///
/// ```sql
/// CREATE TABLE outbox (id int PRIMARY KEY, body text);   -- oid 16384
/// BEGIN; INSERT INTO outbox VALUES (11, 'prep-11'); PREPARE TRANSACTION 'g11';
/// INSERT INTO outbox VALUES (12, 'plain-12');
/// COMMIT PREPARED 'g11';
/// BEGIN; INSERT INTO outbox VALUES (13, 'prep-13'); PREPARE TRANSACTION 'g13';
/// ROLLBACK PREPARED 'g13';
/// ```
///
/// in the order sent (g11's Relation message and the plain transaction's
/// Begin, Insert and Commit left out).
const CAPTURED_TWO_PHASE: [&str; 6] = [
    "6200000000015408780000000001540970000303fe68d59e62000002dc67313100",
    "49000040004e0002740000000231317400000007707265702d3131",
    "500000000000015408780000000001540970000303fe68d59e62000002dc67313100",
    "4b000000000001540a280000000001540a60000303fe68d59eda000002dc67313100",
    "620000000001540ae80000000001540be0000303fe68d59f46000002de67313300",
    "72000000000001540be00000000001540c18000303fe68d59f46000303fe68d59f6e000002de67313300",
];

fn unhex(hex: &str) -> Bytes {
    let byte = |i: usize| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex");
    Bytes::from((0..hex.len()).step_by(2).map(byte).collect::<Vec<u8>>())
}

#[test]
fn captured_two_phase_messages_decode() {
    let [begin, insert, prepare, commit, begin_rolled_back, rollback] =
        CAPTURED_TWO_PHASE.map(|hex| decode(unhex(hex)).expect(hex));
    let prepared_at = 0x3_03FE_68D5_9E62;
    assert_eq!(
        begin,
        Message::BeginPrepare(BeginPrepare {
            prepare_lsn: 0x154_0878,
            end_lsn: 0x154_0970,
            prepare_time: prepared_at,
            xid: 732,
            gid: "g11".into(),
        })
    );
    let Message::Insert(insert) = insert else {
        panic!("{insert:?}");
    };
    assert_eq!(insert.relation_oid, 16384);
    let text = |s: &'static str| Some(Value::Text(Bytes::from_static(s.as_bytes())));
    assert_eq!(insert.tuple.get(1), text("prep-11"));
    assert_eq!(
        prepare,
        Message::Prepare(Prepare {
            flags: 0,
            prepare_lsn: 0x154_0878,
            end_lsn: 0x154_0970,
            prepare_time: prepared_at,
            xid: 732,
            gid: "g11".into(),
        })
    );
    // After the plain transaction, which committed first.
    assert_eq!(
        commit,
        Message::CommitPrepared(CommitPrepared {
            flags: 0,
            commit_lsn: 0x154_0A28,
            end_lsn: 0x154_0A60,
            commit_time: 0x3_03FE_68D5_9EDA,
            xid: 732,
            gid: "g11".into(),
        })
    );
    let Message::BeginPrepare(rolled_back) = begin_rolled_back else {
        panic!("{begin_rolled_back:?}");
    };
    assert_eq!(
        rollback,
        Message::RollbackPrepared(RollbackPrepared {
            flags: 0,
            prepare_end_lsn: rolled_back.end_lsn,
            rollback_end_lsn: 0x154_0C18,
            prepare_time: rolled_back.prepare_time,
            rollback_time: 0x3_03FE_68D5_9F6E,
            xid: rolled_back.xid,
            gid: "g13".into(),
        })
    );
}
