//! Which PostgreSQL service the database runs on, and what that changes for
//! `setup` and `check`.
//!
//! Managed services keep the superuser to themselves and hand their
//! customers an admin role, and each decides what that role may do:
//!
//! | platform | admin role | the relay's role may stream through | logical decoding is turned on by |
//! |----------|------------|-------------------------------------|----------------------------------|
//! | self-managed | a superuser | the REPLICATION attribute (`CREATE ROLE … REPLICATION`) | `wal_level = logical` + restart |
//! | Amazon RDS, Aurora | member of `rds_superuser` | membership in `rds_replication` | `rds.logical_replication = 1` in the (cluster) parameter group + reboot |
//! | Cloud SQL | member of `cloudsqlsuperuser` | `ALTER ROLE … WITH REPLICATION` | the flag `cloudsql.logical_decoding = on` |
//! | Azure flexible server | member of `azure_pg_admin` | `ALTER ROLE … WITH REPLICATION` | the server parameter `wal_level = logical` + restart |
//! | Supabase | `postgres` (the platform's own is `supabase_admin`) | `ALTER ROLE … WITH REPLICATION` | nothing: its replication guide has no such step |
//! | Neon | member of `neon_superuser` | `ALTER ROLE … WITH REPLICATION` (or a role made in Neon's Console) | Project settings → Logical Replication |
//!
//! docs/managed-postgres.md says where each row comes from.
//!
//! The platform is told from the server's roles ([`detect`], a pure function
//! of [`Facts`], which [`FACTS_SQL`] reads in one query any role may run):
//! each service creates its admin roles in every cluster, and ordinary
//! installations do not have them. A role name alone can be copied (a dump of
//! roles restored elsewhere), so `setup --platform` overrides the guess, and
//! the guess names what it saw. Aurora is RDS plus the function
//! `aurora_version()`, which Aurora documents and RDS does not have.

use std::fmt;

use tokio_postgres::error::SqlState;

/// Where PostgreSQL runs, as far as the relay's setup differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Platform {
    /// PostgreSQL run by its users, with a superuser at hand.
    SelfManaged,
    /// Amazon RDS for PostgreSQL.
    Rds,
    /// Amazon Aurora PostgreSQL-Compatible Edition.
    Aurora,
    /// Google Cloud SQL for PostgreSQL.
    CloudSql,
    /// Azure Database for PostgreSQL flexible server.
    Azure,
    /// Supabase.
    Supabase,
    /// Neon.
    Neon,
}

/// Every platform, in `--platform`'s order.
pub(crate) const ALL: [Platform; 7] = [
    Platform::SelfManaged,
    Platform::Rds,
    Platform::Aurora,
    Platform::CloudSql,
    Platform::Azure,
    Platform::Supabase,
    Platform::Neon,
];

/// The role file for RDS and Aurora.
const ROLE_RDS: (&str, &str) = (
    "004_role_rds.sql",
    include_str!("../../../../sql/004_role_rds.sql"),
);

/// The role file for the services whose admin role gives REPLICATION with
/// `ALTER ROLE`.
const ROLE_ALTER: (&str, &str) = (
    "004_role_alter.sql",
    include_str!("../../../../sql/004_role_alter.sql"),
);

impl Platform {
    /// Its name, for people.
    pub fn name(self) -> &'static str {
        match self {
            Platform::SelfManaged => "self-managed PostgreSQL",
            Platform::Rds => "Amazon RDS for PostgreSQL",
            Platform::Aurora => "Amazon Aurora PostgreSQL",
            Platform::CloudSql => "Google Cloud SQL for PostgreSQL",
            Platform::Azure => "Azure Database for PostgreSQL flexible server",
            Platform::Supabase => "Supabase",
            Platform::Neon => "Neon",
        }
    }

    /// Its `--platform` value.
    pub fn flag(self) -> &'static str {
        match self {
            Platform::SelfManaged => "self-managed",
            Platform::Rds => "rds",
            Platform::Aurora => "aurora",
            Platform::CloudSql => "cloud-sql",
            Platform::Azure => "azure",
            Platform::Supabase => "supabase",
            Platform::Neon => "neon",
        }
    }

    /// The section of docs/managed-postgres.md about it.
    pub fn docs(self) -> &'static str {
        match self {
            Platform::SelfManaged => "README.md, \"Using it on your database\"",
            Platform::Rds => "docs/managed-postgres.md#amazon-rds-for-postgresql",
            Platform::Aurora => "docs/managed-postgres.md#amazon-aurora-postgresql",
            Platform::CloudSql => "docs/managed-postgres.md#google-cloud-sql-for-postgresql",
            Platform::Azure => {
                "docs/managed-postgres.md#azure-database-for-postgresql-flexible-server"
            }
            Platform::Supabase => "docs/managed-postgres.md#supabase",
            Platform::Neon => "docs/managed-postgres.md#neon",
        }
    }

    /// The file that creates the relay's role here, in place of
    /// `004_role.sql`; `None` where that one works (a superuser runs it).
    pub fn role_file(self) -> Option<(&'static str, &'static str)> {
        match self {
            Platform::SelfManaged => None,
            Platform::Rds | Platform::Aurora => Some(ROLE_RDS),
            Platform::CloudSql | Platform::Azure | Platform::Supabase | Platform::Neon => {
                Some(ROLE_ALTER)
            }
        }
    }

    /// How to get `wal_level = logical` here: the fix of
    /// [`crate::postgres::readiness::Problem::WalLevel`].
    pub fn logical_decoding_fix(self) -> String {
        let how = match self {
            // Word for word what check said before it knew of platforms.
            Platform::SelfManaged => {
                return "ALTER SYSTEM SET wal_level = logical, then restart Postgres".into()
            }
            Platform::Rds => {
                "set rds.logical_replication = 1 in the instance's DB parameter group (a custom \
                 group: the default one cannot be edited) and reboot the instance (the parameter \
                 is static); wal_level then becomes logical"
            }
            Platform::Aurora => {
                "set rds.logical_replication = 1 in the DB cluster parameter group (a custom \
                 group) and reboot the writer instance; wal_level then becomes logical"
            }
            Platform::CloudSql => {
                "set the database flag cloudsql.logical_decoding to on (console: Edit, Flags); \
                 the instance restarts to apply it"
            }
            Platform::Azure => {
                "set the server parameter wal_level to logical (portal: Server parameters), save \
                 and restart the server"
            }
            Platform::Supabase => {
                "Supabase runs projects with logical decoding on, and its replication guide has \
                 no step to turn it on: ask Supabase support about this project (self-hosted: \
                 wal_level = logical in postgresql.conf, then restart)"
            }
            Platform::Neon => {
                "enable logical replication in the Neon Console (Project settings, Logical \
                 Replication, Enable); it restarts the project's computes and cannot be undone"
            }
        };
        format!("on {}: {how} ({})", self.name(), self.docs())
    }

    /// What to do when `setup --apply` failed in `file` with `code`, beyond
    /// the server's own words.
    pub fn setup_hint(self, file: &str, code: &SqlState) -> Option<String> {
        if *code != SqlState::INSUFFICIENT_PRIVILEGE {
            return None;
        }
        let step = file.get(..3).unwrap_or_default();
        let hint = match (step, self) {
            ("001", _) => {
                "creating the table needs CREATE on its schema: run setup as the schema's owner \
                 (from PostgreSQL 15 on, public belongs to the database's owner)"
                    .to_owned()
            }
            ("002", _) => "CREATE PUBLICATION ... FOR TABLE needs CREATE on the database and \
                 ownership of the table: run setup as the table's owner"
                .to_owned(),
            ("003", Platform::Rds | Platform::Aurora) => {
                "creating a slot needs rds_replication (AWS asks for rds_superuser and \
                 rds_replication): GRANT rds_replication TO CURRENT_USER, as the master user, \
                 then run setup again"
                    .to_owned()
            }
            ("003", Platform::Azure) => {
                "Azure's admin role needs REPLICATION itself before it creates a slot: ALTER \
                 ROLE CURRENT_USER WITH REPLICATION, then run setup again"
                    .to_owned()
            }
            ("003", Platform::CloudSql) => {
                "creating a slot needs REPLICATION: ALTER USER CURRENT_USER WITH REPLICATION, \
                 as a member of cloudsqlsuperuser, then run setup again"
                    .to_owned()
            }
            ("003", _) => "creating a slot needs the REPLICATION attribute (or a superuser): run \
                 setup as a role that has it"
                .to_owned(),
            ("004", Platform::SelfManaged) => {
                "CREATE ROLE ... REPLICATION needs a superuser (PostgreSQL 15 and older) or a \
                 role with CREATEROLE and REPLICATION (16 and later); on a managed service, \
                 choose it with --platform (rds, aurora, cloud-sql, azure, supabase, neon)"
                    .to_owned()
            }
            ("004", Platform::Rds | Platform::Aurora) => {
                "run setup as the master user: creating the role needs CREATEROLE, granting \
                 rds_replication needs rds_superuser"
                    .to_owned()
            }
            ("004", Platform::Neon) => {
                "Neon has documented that roles created with SQL cannot be given REPLICATION: \
                 create the role in the Neon Console, CLI or API instead (it then has \
                 REPLICATION, and as a member of neon_superuser may also read and write all \
                 data), and run setup again with --role and its name"
                    .to_owned()
            }
            ("004", platform) => format!(
                "run setup as the admin role of {} (it creates roles and gives them \
                 REPLICATION)",
                platform.name()
            ),
            _ => return None,
        };
        Some(format!("{hint}; see {}", self.docs()))
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What `setup --platform` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Choice {
    /// Tell it from the server ([`detect`]).
    Auto,
    /// This one.
    Given(Platform),
}

impl std::str::FromStr for Choice {
    type Err = String;

    fn from_str(text: &str) -> Result<Choice, String> {
        if text == "auto" {
            return Ok(Choice::Auto);
        }
        ALL.iter()
            .find(|p| p.flag() == text)
            .map(|p| Choice::Given(*p))
            .ok_or_else(|| {
                let values: Vec<&str> = std::iter::once("auto")
                    .chain(ALL.iter().map(|p| p.flag()))
                    .collect();
                format!("unknown platform {text:?}; one of {}", values.join(", "))
            })
    }
}

/// The roles whose presence tells a platform.
pub(crate) const MARKER_ROLES: &[&str] = &[
    "rds_superuser",
    "rds_replication",
    "cloudsqlsuperuser",
    "azure_pg_admin",
    "supabase_admin",
    "neon_superuser",
];

/// The platforms' own switches for logical decoding, reported with the
/// roles (read through `pg_settings`, which leaves out what the role may not
/// read instead of failing).
pub(crate) const SETTINGS: &[&str] = &["rds.logical_replication", "cloudsql.logical_decoding"];

/// One query, for any role on PostgreSQL 14–18: which of
/// [`MARKER_ROLES`] exist (`$1`), which of [`SETTINGS`] exist and their values
/// (`$2`), and whether a function `aurora_version` exists.
pub(crate) const FACTS_SQL: &str = "\
SELECT ARRAY(SELECT rolname::text FROM pg_catalog.pg_roles \
             WHERE rolname = ANY($1::text[]) ORDER BY 1), \
       ARRAY(SELECT name FROM pg_catalog.pg_settings WHERE name = ANY($2::text[]) ORDER BY 1), \
       ARRAY(SELECT setting FROM pg_catalog.pg_settings WHERE name = ANY($2::text[]) ORDER BY name), \
       EXISTS (SELECT 1 FROM pg_catalog.pg_proc WHERE proname = 'aurora_version')";

/// What the server shows of its platform.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Facts {
    /// Those of [`MARKER_ROLES`] that exist.
    pub roles: Vec<String>,
    /// Those of [`SETTINGS`] that exist, with their values.
    pub settings: Vec<(String, String)>,
    /// Whether a function `aurora_version` exists.
    pub aurora_version: bool,
}

impl Facts {
    fn has(&self, role: &str) -> bool {
        self.roles.iter().any(|r| r == role)
    }

    fn setting(&self, name: &str) -> Option<&str> {
        self.settings
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The platform [`detect`] chose, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Detection {
    /// The platform.
    pub platform: Platform,
    /// What it was told from, for people: "role rds_superuser, …".
    pub evidence: String,
}

/// The platforms whose marks are in `facts`, each with what marks it, in
/// the order [`detect`] prefers them.
fn candidates(facts: &Facts) -> Vec<(Platform, Vec<String>)> {
    let mut found = Vec::new();
    let role = |name: &str| format!("role {name}");
    if facts.has("rds_superuser") && facts.has("rds_replication") {
        let mut marks = vec![role("rds_superuser"), role("rds_replication")];
        let platform = if facts.aurora_version {
            marks.push("function aurora_version()".into());
            Platform::Aurora
        } else {
            Platform::Rds
        };
        if let Some(value) = facts.setting("rds.logical_replication") {
            marks.push(format!("rds.logical_replication = {value}"));
        }
        found.push((platform, marks));
    }
    if facts.has("cloudsqlsuperuser") {
        let mut marks = vec![role("cloudsqlsuperuser")];
        if let Some(value) = facts.setting("cloudsql.logical_decoding") {
            marks.push(format!("cloudsql.logical_decoding = {value}"));
        }
        found.push((Platform::CloudSql, marks));
    }
    for (name, platform) in [
        ("azure_pg_admin", Platform::Azure),
        ("supabase_admin", Platform::Supabase),
        ("neon_superuser", Platform::Neon),
    ] {
        if facts.has(name) {
            found.push((platform, vec![role(name)]));
        }
    }
    found
}

/// The platform `facts` show: the first of RDS or Aurora (both of
/// `rds_superuser` and `rds_replication`; Aurora when `aurora_version()`
/// exists too), Cloud SQL (`cloudsqlsuperuser`), Azure (`azure_pg_admin`),
/// Supabase (`supabase_admin`) and Neon (`neon_superuser`) whose roles exist;
/// self-managed when none do. When several do, the evidence names the others.
pub(crate) fn detect(facts: &Facts) -> Detection {
    let mut found = candidates(facts).into_iter();
    let Some((platform, marks)) = found.next() else {
        let evidence = if facts.roles.is_empty() {
            format!("none of the roles {}", MARKER_ROLES.join(", "))
        } else {
            format!(
                "of the platforms' roles only {}, which is no platform's set",
                facts.roles.join(", ")
            )
        };
        return Detection {
            platform: Platform::SelfManaged,
            evidence,
        };
    };
    let mut evidence = marks.join(", ");
    let others: Vec<String> = found
        .map(|(p, marks)| format!("{} ({})", p.flag(), marks.join(", ")))
        .collect();
    if !others.is_empty() {
        evidence.push_str(&format!(
            "; also the marks of {}: choose with --platform if this is not {}",
            others.join(", "),
            platform.flag()
        ));
    }
    Detection { platform, evidence }
}

/// Read the [`Facts`] with [`FACTS_SQL`].
pub(crate) async fn facts(client: &tokio_postgres::Client) -> Result<Facts, tokio_postgres::Error> {
    let row = client
        .query_one(FACTS_SQL, &[&MARKER_ROLES, &SETTINGS])
        .await?;
    let names: Vec<String> = row.get(1);
    let values: Vec<String> = row.get(2);
    Ok(Facts {
        roles: row.get(0),
        settings: names.into_iter().zip(values).collect(),
        aurora_version: row.get(3),
    })
}

/// The platform of the server `client` is connected to.
pub(crate) async fn detect_on(
    client: &tokio_postgres::Client,
) -> Result<Detection, tokio_postgres::Error> {
    Ok(detect(&facts(client).await?))
}

/// Like [`detect_on`], for texts only: self-managed when the facts cannot be
/// read, so that telling the platform never fails `check` or `run`.
pub(crate) async fn detect_or_self_managed(client: &tokio_postgres::Client) -> Platform {
    match detect_on(client).await {
        Ok(detection) => detection.platform,
        Err(e) => {
            tracing::debug!(error = %crate::report::Chain(&e), "cannot tell the platform; self-managed wording");
            Platform::SelfManaged
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(roles: &[&str], aurora_version: bool) -> Facts {
        Facts {
            roles: roles.iter().map(|r| r.to_string()).collect(),
            settings: Vec::new(),
            aurora_version,
        }
    }

    #[test]
    fn each_platform_is_told_from_its_roles_and_anything_else_is_self_managed() {
        use Platform::*;
        let cases: &[(&[&str], bool, Platform)] = &[
            (&[], false, SelfManaged),
            (&["rds_superuser", "rds_replication"], false, Rds),
            (&["rds_superuser", "rds_replication"], true, Aurora),
            // One of the two is a copy, not RDS: the role file needs both.
            (&["rds_superuser"], false, SelfManaged),
            (&["rds_replication"], true, SelfManaged),
            // A function of that name alone is anybody's.
            (&[], true, SelfManaged),
            (&["cloudsqlsuperuser"], false, CloudSql),
            (&["azure_pg_admin"], false, Azure),
            (&["supabase_admin"], false, Supabase),
            (&["neon_superuser"], false, Neon),
            // Several: the first in the order, the others named.
            (
                &["cloudsqlsuperuser", "rds_replication", "rds_superuser"],
                false,
                Rds,
            ),
            (&["neon_superuser", "supabase_admin"], false, Supabase),
        ];
        for (roles, aurora, platform) in cases {
            let detection = detect(&facts(roles, *aurora));
            assert_eq!(detection.platform, *platform, "{roles:?} {aurora}");
            // What it was told from is named.
            assert!(
                roles.iter().all(|role| detection.evidence.contains(role)),
                "{roles:?}: {}",
                detection.evidence
            );
        }
        let both = detect(&facts(
            &["cloudsqlsuperuser", "rds_replication", "rds_superuser"],
            false,
        ));
        assert!(
            both.evidence.contains("also the marks of cloud-sql")
                && both.evidence.contains("--platform"),
            "{}",
            both.evidence
        );
        let aurora = detect(&facts(&["rds_superuser", "rds_replication"], true));
        assert!(
            aurora.evidence.contains("aurora_version()"),
            "{}",
            aurora.evidence
        );
    }

    #[test]
    fn the_platforms_own_switch_is_named_in_the_evidence() {
        let mut cloud = facts(&["cloudsqlsuperuser"], false);
        cloud.settings = vec![("cloudsql.logical_decoding".into(), "off".into())];
        assert_eq!(
            detect(&cloud).evidence,
            "role cloudsqlsuperuser, cloudsql.logical_decoding = off"
        );
        let mut rds = facts(&["rds_replication", "rds_superuser"], false);
        rds.settings = vec![("rds.logical_replication".into(), "on".into())];
        assert!(detect(&rds)
            .evidence
            .ends_with("rds.logical_replication = on"));
    }

    #[test]
    fn every_platform_has_a_flag_a_role_file_and_its_own_words_for_logical_decoding() {
        for platform in ALL {
            assert_eq!(
                platform.flag().parse::<Choice>(),
                Ok(Choice::Given(platform))
            );
            let fix = platform.logical_decoding_fix();
            let setting = match platform {
                Platform::SelfManaged => "ALTER SYSTEM SET wal_level = logical",
                Platform::Rds | Platform::Aurora => "rds.logical_replication = 1",
                Platform::CloudSql => "cloudsql.logical_decoding",
                Platform::Azure => "server parameter wal_level",
                Platform::Supabase => "Supabase support",
                Platform::Neon => "Neon Console",
            };
            assert!(fix.contains(setting), "{platform:?}: {fix}");
            if platform != Platform::SelfManaged {
                assert!(fix.contains(platform.docs()), "{fix}");
                assert!(platform.docs().starts_with("docs/managed-postgres.md#"));
            }
        }
        assert_eq!("auto".parse::<Choice>(), Ok(Choice::Auto));
        let unknown = "heroku".parse::<Choice>().unwrap_err();
        assert!(
            unknown.contains("cloud-sql") && unknown.contains("auto"),
            "{unknown}"
        );
        assert_eq!(Platform::Aurora.role_file().unwrap().0, "004_role_rds.sql");
        assert_eq!(Platform::Neon.role_file().unwrap().0, "004_role_alter.sql");
        assert_eq!(Platform::SelfManaged.role_file(), None);
    }

    #[test]
    fn a_refused_setup_step_says_what_the_platform_needs() {
        let denied = SqlState::INSUFFICIENT_PRIVILEGE;
        let hint = |p: Platform, file: &str| p.setup_hint(file, &denied).unwrap_or_default();
        assert!(
            hint(Platform::Rds, "003_slot.sql").contains("GRANT rds_replication TO CURRENT_USER")
        );
        assert!(hint(Platform::Azure, "003_slot.sql")
            .contains("ALTER ROLE CURRENT_USER WITH REPLICATION"));
        assert!(hint(Platform::Neon, "004_role_alter.sql").contains("Neon Console"));
        assert!(hint(Platform::SelfManaged, "004_role.sql").contains("--platform"));
        assert!(hint(Platform::CloudSql, "002_publication.sql").contains("table's owner"));
        assert_eq!(
            Platform::Rds.setup_hint("003_slot.sql", &SqlState::UNDEFINED_TABLE),
            None
        );
        assert_eq!(
            Platform::Rds.setup_hint("005_dead_letter.sql", &denied),
            None
        );
    }
}
