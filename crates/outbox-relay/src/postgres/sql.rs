//! Quoting for the SQL text the relay builds itself.
//!
//! Identifiers cannot be bind parameters, so the configured schema, table and
//! column names (and the partitions the catalog lists) are written into the
//! statements; they are quoted as the server's `quote_ident` and
//! `quote_literal` would quote them, so any name the server accepts works and
//! none can change the statement.

/// Quote an identifier the way Postgres's `quote_ident` does.
pub(crate) fn quote_ident(name: &str) -> String {
    let plain = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !name.as_bytes()[0].is_ascii_digit()
        && !RESERVED.contains(&name);
    if plain {
        name.to_owned()
    } else {
        format!("\"{}\"", name.replace('"', "\"\""))
    }
}

/// Quote a string literal.
pub(crate) fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// `schema.name`, each part quoted as needed: a table's name in SQL text.
pub(crate) fn qualified(schema: &str, name: &str) -> String {
    format!("{}.{}", quote_ident(schema), quote_ident(name))
}

/// PostgreSQL's reserved key words (SQL Key Words appendix, "reserved" and
/// "reserved (can be function or type)"): these may not stand unquoted as
/// names.
const RESERVED: &[&str] = &[
    "all",
    "analyse",
    "analyze",
    "and",
    "any",
    "array",
    "as",
    "asc",
    "asymmetric",
    "authorization",
    "binary",
    "both",
    "case",
    "cast",
    "check",
    "collate",
    "collation",
    "column",
    "concurrently",
    "constraint",
    "create",
    "cross",
    "current_catalog",
    "current_date",
    "current_role",
    "current_schema",
    "current_time",
    "current_timestamp",
    "current_user",
    "default",
    "deferrable",
    "desc",
    "distinct",
    "do",
    "else",
    "end",
    "except",
    "false",
    "fetch",
    "for",
    "foreign",
    "freeze",
    "from",
    "full",
    "grant",
    "group",
    "having",
    "ilike",
    "in",
    "initially",
    "inner",
    "intersect",
    "into",
    "is",
    "isnull",
    "join",
    "lateral",
    "leading",
    "left",
    "like",
    "limit",
    "localtime",
    "localtimestamp",
    "natural",
    "not",
    "notnull",
    "null",
    "offset",
    "on",
    "only",
    "or",
    "order",
    "outer",
    "overlaps",
    "placing",
    "primary",
    "references",
    "returning",
    "right",
    "select",
    "session_user",
    "similar",
    "some",
    "symmetric",
    "system_user",
    "table",
    "tablesample",
    "then",
    "to",
    "trailing",
    "true",
    "union",
    "unique",
    "user",
    "using",
    "variadic",
    "verbose",
    "when",
    "where",
    "window",
    "with",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted_only_when_needed() {
        assert_eq!(quote_ident("outbox"), "outbox");
        assert_eq!(quote_ident("Outbox"), "\"Outbox\"");
        assert_eq!(quote_ident("user"), "\"user\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }

    #[test]
    fn literals_double_their_quotes() {
        assert_eq!(quote_literal("outbox"), "'outbox'");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }

    #[test]
    fn a_qualified_name_quotes_each_part_on_its_own() {
        assert_eq!(qualified("public", "outbox"), "public.outbox");
        assert_eq!(qualified("App", "user"), "\"App\".\"user\"");
    }
}
