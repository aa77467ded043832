//! The single error type of the decoder.

/// Why a buffer is not a valid pgoutput message.
///
/// Offsets count from the start of the buffer given to [`decode`](crate::decode),
/// i.e. the message type byte is at offset 0.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The buffer holds no bytes at all.
    #[error("empty pgoutput message")]
    Empty,
    /// The first byte is not a message type the decoder knows (streaming's
    /// `'S'`, `'E'`, `'c'`, `'A'` among them).
    #[error("unknown pgoutput message type {0:#04x}")]
    UnknownMessage(u8),
    /// The buffer ends in the middle of a field.
    #[error("truncated {message} message: needed {needed} more bytes at offset {offset}")]
    Truncated {
        /// Name of the message kind being decoded, e.g. `"Insert"`.
        message: &'static str,
        /// Offset of the field that does not fit.
        offset: usize,
        /// How many bytes beyond the end of the buffer that field needs.
        needed: usize,
    },
    /// A field holds a value the protocol does not allow.
    #[error("invalid {message} message at offset {offset}: {reason}")]
    Invalid {
        /// Name of the message kind being decoded, e.g. `"Relation"`.
        message: &'static str,
        /// Offset of the offending field.
        offset: usize,
        /// What is wrong, e.g. `"string is not UTF-8"` or `"trailing bytes"`.
        reason: &'static str,
    },
}
