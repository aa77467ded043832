//! Inputs the decoder must reject, each with the error it reports.

use bytes::Bytes;

use super::messages::samples;
use super::wire::Wire;
use crate::{decode, DecodeError};

fn invalid(message: &'static str, offset: usize, reason: &'static str) -> DecodeError {
    DecodeError::Invalid {
        message,
        offset,
        reason,
    }
}

#[test]
fn every_strict_prefix_is_an_error() {
    for sample in samples() {
        assert!(decode(sample.clone()).is_ok(), "sample {sample:?}");
        for len in 0..sample.len() {
            let prefix = sample.slice(..len);
            assert!(decode(prefix.clone()).is_err(), "prefix {prefix:?} decoded");
        }
    }
}

#[test]
fn prefixes_cut_inside_fixed_fields_are_truncated() {
    for sample in samples() {
        // Only the type byte: the first field is missing.
        let err = decode(sample.slice(..1)).expect_err("prefix decoded");
        assert!(
            matches!(err, DecodeError::Truncated { offset: 1, .. }),
            "{err:?}"
        );
    }
}

#[test]
fn every_sample_with_a_trailing_byte_is_rejected() {
    for sample in samples() {
        let mut longer = sample.to_vec();
        longer.push(0);
        assert_eq!(
            decode(Bytes::from(longer)),
            Err(DecodeError::Invalid {
                message: message_name(sample[0]),
                offset: sample.len(),
                reason: "trailing bytes"
            })
        );
    }
}

fn message_name(kind: u8) -> &'static str {
    match kind {
        b'B' => "Begin",
        b'C' => "Commit",
        b'O' => "Origin",
        b'R' => "Relation",
        b'Y' => "Type",
        b'I' => "Insert",
        b'U' => "Update",
        b'D' => "Delete",
        b'T' => "Truncate",
        b'M' => "Message",
        b'b' => "Begin Prepare",
        b'P' => "Prepare",
        b'K' => "Commit Prepared",
        b'r' => "Rollback Prepared",
        b'p' => "Stream Prepare",
        _ => unreachable!("samples only hold known kinds"),
    }
}

#[test]
fn empty_buffer() {
    assert_eq!(decode(Bytes::new()), Err(DecodeError::Empty));
    assert_eq!(DecodeError::Empty.to_string(), "empty pgoutput message");
}

#[test]
fn unknown_message_types() {
    // Streaming messages (protocol 2+, never asked for) and junk.
    for kind in [b'S', b'E', b'c', b'A', b'k', b'X', 0, 0xff] {
        assert_eq!(
            decode(Bytes::from(vec![kind, 0, 0, 0, 0])),
            Err(DecodeError::UnknownMessage(kind))
        );
    }
    assert_eq!(
        DecodeError::UnknownMessage(b'S').to_string(),
        "unknown pgoutput message type 0x53"
    );
}

#[test]
fn two_phase_messages_cut_inside_their_fields() {
    // Begin Prepare without the xid's last byte and the gid.
    let err = decode(Wire::msg(b'b').u64(1).u64(2).i64(3).raw(&[0, 0, 1]).build()).unwrap_err();
    assert_eq!(
        err,
        DecodeError::Truncated {
            message: "Begin Prepare",
            offset: 25,
            needed: 1
        }
    );
    // Rollback Prepared that stops after its prepare time.
    let err = decode(Wire::msg(b'r').u8(0).u64(1).u64(2).i64(3).build()).unwrap_err();
    assert_eq!(
        err,
        DecodeError::Truncated {
            message: "Rollback Prepared",
            offset: 26,
            needed: 8
        }
    );
}

#[test]
fn a_gid_without_its_terminator_or_not_utf8() {
    let head = || Wire::msg(b'K').u8(0).u64(1).u64(2).i64(3).u32(4);
    assert_eq!(
        decode(head().raw(b"order-42").build()),
        Err(invalid("Commit Prepared", 30, "string not NUL-terminated"))
    );
    assert_eq!(
        decode(head().raw(&[b'g', 0xc3, 0x28, 0]).build()),
        Err(invalid("Commit Prepared", 30, "string is not UTF-8"))
    );
    let prepare = Wire::msg(b'P').u8(0).u64(1).u64(2).i64(3).u32(4);
    assert_eq!(
        decode(prepare.str("g").u8(0).build()),
        Err(invalid("Prepare", 32, "trailing bytes"))
    );
    assert_eq!(
        decode(Wire::msg(b'p').u8(0).u64(1).build()),
        Err(DecodeError::Truncated {
            message: "Stream Prepare",
            offset: 10,
            needed: 8
        })
    );
}

#[test]
fn truncated_begin_reports_missing_bytes() {
    let err = decode(Wire::msg(b'B').u64(1).i64(2).u8(0).build()).unwrap_err();
    assert_eq!(
        err,
        DecodeError::Truncated {
            message: "Begin",
            offset: 17,
            needed: 3
        }
    );
    assert_eq!(
        err.to_string(),
        "truncated Begin message: needed 3 more bytes at offset 17"
    );
}

#[test]
fn unknown_tuple_column_kind() {
    let wire = Wire::msg(b'I')
        .u32(1)
        .u8(b'N')
        .u16(2)
        .u8(b'n')
        .u8(b'x')
        .build();
    let err = decode(wire).unwrap_err();
    assert_eq!(err, invalid("Insert", 9, "unknown tuple column kind"));
    assert_eq!(
        err.to_string(),
        "invalid Insert message at offset 9: unknown tuple column kind"
    );
}

#[test]
fn tuple_with_fewer_columns_than_counted() {
    let wire = Wire::msg(b'I').u32(1).u8(b'N').u16(3).u8(b'n').build();
    assert!(matches!(
        decode(wire),
        Err(DecodeError::Truncated {
            message: "Insert",
            offset: 9,
            needed: 1
        })
    ));
}

#[test]
fn negative_value_length() {
    let wire = Wire::msg(b'I')
        .u32(1)
        .u8(b'N')
        .u16(1)
        .u8(b't')
        .i32(-1)
        .build();
    assert_eq!(decode(wire), Err(invalid("Insert", 9, "negative length")));
}

#[test]
fn value_longer_than_buffer() {
    let wire = Wire::msg(b'I')
        .u32(1)
        .u8(b'N')
        .u16(1)
        .u8(b'b')
        .i32(i32::MAX)
        .raw(b"abc")
        .build();
    assert_eq!(
        decode(wire),
        Err(DecodeError::Truncated {
            message: "Insert",
            offset: 13,
            needed: (i32::MAX - 3) as usize
        })
    );
}

#[test]
fn negative_message_content_length() {
    let wire = Wire::msg(b'M').u8(1).u64(1).str("p").i32(-5).build();
    assert_eq!(decode(wire), Err(invalid("Message", 12, "negative length")));
}

#[test]
fn negative_truncate_count() {
    let wire = Wire::msg(b'T').i32(-1).u8(0).build();
    assert_eq!(decode(wire), Err(invalid("Truncate", 1, "negative count")));
}

#[test]
fn huge_counts_fail_fast() {
    // 65535 columns claimed in a few bytes.
    let relation = Wire::msg(b'R')
        .u32(1)
        .str("")
        .str("")
        .u8(b'd')
        .u16(u16::MAX)
        .build();
    assert!(matches!(
        decode(relation),
        Err(DecodeError::Truncated { .. })
    ));
    let truncate = Wire::msg(b'T').i32(i32::MAX).u8(0).u32(1).build();
    assert_eq!(
        decode(truncate),
        Err(DecodeError::Truncated {
            message: "Truncate",
            offset: 6,
            needed: (i32::MAX as usize) * 4 - 4
        })
    );
    let tuple = Wire::msg(b'I').u32(1).u8(b'N').u16(u16::MAX).build();
    assert!(matches!(decode(tuple), Err(DecodeError::Truncated { .. })));
}

#[test]
fn string_without_nul() {
    let wire = Wire::msg(b'O').u64(1).raw(b"no-terminator").build();
    assert_eq!(
        decode(wire),
        Err(invalid("Origin", 9, "string not NUL-terminated"))
    );
}

#[test]
fn string_not_utf8() {
    let wire = Wire::msg(b'Y')
        .u32(1)
        .str("public")
        .raw(&[0xc3, 0x28, 0])
        .build();
    assert_eq!(
        decode(wire),
        Err(invalid("Type", 12, "string is not UTF-8"))
    );
}

#[test]
fn column_name_not_utf8() {
    let wire = Wire::msg(b'R')
        .u32(1)
        .str("s")
        .str("t")
        .u8(b'd')
        .u16(1)
        .u8(0)
        .raw(&[0xff, 0])
        .u32(25)
        .i32(-1)
        .build();
    assert_eq!(
        decode(wire),
        Err(invalid("Relation", 13, "string is not UTF-8"))
    );
}

#[test]
fn trailing_bytes_after_begin() {
    let wire = Wire::msg(b'B').u64(1).i64(2).u32(3).u8(0).build();
    assert_eq!(decode(wire), Err(invalid("Begin", 21, "trailing bytes")));
}

#[test]
fn unknown_tuple_markers() {
    let insert = Wire::msg(b'I').u32(1).u8(b'K').u16(0).build();
    assert_eq!(
        decode(insert),
        Err(invalid("Insert", 5, "unknown tuple marker"))
    );
    let update = Wire::msg(b'U').u32(1).u8(b'X').u16(0).build();
    assert_eq!(
        decode(update),
        Err(invalid("Update", 5, "unknown tuple marker"))
    );
    // Old key followed by something other than the new tuple.
    let update = Wire::msg(b'U')
        .u32(1)
        .u8(b'K')
        .u16(0)
        .u8(b'K')
        .u16(0)
        .build();
    assert_eq!(
        decode(update),
        Err(invalid("Update", 8, "unknown tuple marker"))
    );
    let delete = Wire::msg(b'D').u32(1).u8(b'N').u16(0).build();
    assert_eq!(
        decode(delete),
        Err(invalid("Delete", 5, "unknown tuple marker"))
    );
}

#[test]
fn update_with_two_new_tuples_has_trailing_bytes() {
    let wire = Wire::msg(b'U')
        .u32(1)
        .u8(b'N')
        .u16(0)
        .u8(b'N')
        .u16(0)
        .build();
    assert_eq!(decode(wire), Err(invalid("Update", 8, "trailing bytes")));
}
