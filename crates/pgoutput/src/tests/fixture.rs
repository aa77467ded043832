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

use crate::{decode, Message, Value};

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
