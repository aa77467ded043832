#!/usr/bin/env python3
"""Validate Compose files against the vendored Compose Specification schema.

    python3 scripts/validate-compose.py                 # docker-compose.yml of this repo
    python3 scripts/validate-compose.py FILE [FILE...]  # other Compose files
    python3 scripts/validate-compose.py --schema SCHEMA.json FILE

For each file:
  * it must validate against tests/data/compose-spec.json (the JSON Schema
    draft its `$schema` names), after `${VAR}` / `${VAR:-default}`
    interpolation from the environment, as Compose does;
  * every bind-mount source (short `./src:/dst[:mode]` syntax and long syntax
    `type: bind`), every `build` context and its Dockerfile, every `env_file`
    (unless `required: false`) and every top-level `configs`/`secrets` `file`
    must exist, relative to the Compose file's directory.

Each problem is printed on a line of its own and the exit code is 1; with
none, one summary line and exit code 0. Exit code 2: bad usage, or PyYAML
or jsonschema missing (python3 -m pip install pyyaml jsonschema).
"""

import argparse
import json
import os
import re
import sys

try:
    import jsonschema
    import yaml
except ImportError as missing:
    print(
        f"error: {missing.name} is not installed: python3 -m pip install pyyaml jsonschema",
        file=sys.stderr,
    )
    sys.exit(2)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FILE = os.path.join(REPO, "docker-compose.yml")
DEFAULT_SCHEMA = os.path.join(REPO, "tests", "data", "compose-spec.json")

# $$ (a literal $), ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?err},
# ${NAME?err}, ${NAME:+alt}, ${NAME+alt}, $NAME.
VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value, problems, where):
    """Interpolate environment variables into every string value (not keys)."""
    if isinstance(value, dict):
        return {k: interpolate(v, problems, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, problems, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match):
        if match.group("escaped"):
            return "$"
        name = match.group("braced") or match.group("named")
        op, arg = match.group("op"), match.group("arg") or ""
        current = os.environ.get(name)
        unset_or_empty = not current if op and op.startswith(":") else current is None
        if op in (":-", "-"):
            return arg if unset_or_empty else current
        if op in (":?", "?"):
            if unset_or_empty:
                problems.append(f"{where}: required variable {name} is not set ({arg})")
                return ""
            return current
        if op in (":+", "+"):
            return "" if unset_or_empty else arg
        return current or ""

    return VARIABLE.sub(substitute, value)


def validator_class_for(schema):
    """The validator of the draft `$schema` names. The Compose schema writes
    https://json-schema.org/draft-07/schema (https, no trailing #), which
    jsonschema's registry does not know by that spelling, so go by the draft's
    name."""
    uri = schema.get("$schema", "")
    for draft, cls in (
        ("draft-04", jsonschema.Draft4Validator),
        ("draft-06", jsonschema.Draft6Validator),
        ("draft-07", jsonschema.Draft7Validator),
        ("2019-09", jsonschema.Draft201909Validator),
        ("2020-12", jsonschema.Draft202012Validator),
    ):
        if draft in uri:
            return cls
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)


def schema_problems(document, schema):
    validator_class = validator_class_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema)
    problems = []
    for error in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path))):
        path = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        problems.append(f"{path}: {error.message}")
    return problems


def is_path(source):
    """A short-syntax volume source is a host path when it looks like one."""
    return source.startswith((".", "/", "~")) or re.match(r"^[A-Za-z]:[\\/]", source) is not None


def short_volume_source(spec):
    """The source of `src:dst[:mode]`, or None for an anonymous volume."""
    # A Windows drive letter (C:\x:/y) keeps its colon.
    drive = re.match(r"^[A-Za-z]:[\\/]", spec)
    head, rest = (spec[:2], spec[2:]) if drive else ("", spec)
    parts = rest.split(":")
    if len(parts) < 2:
        return None
    return head + parts[0]


def remote_context(context):
    return "://" in context or context.startswith(("git@", "github.com/"))


class Checker:
    def __init__(self, base):
        self.base = base
        self.problems = []
        self.checked = {"bind-mount sources": 0, "build contexts": 0, "other files": 0}

    def resolve(self, path):
        return os.path.normpath(os.path.join(self.base, os.path.expanduser(path)))

    def must_exist(self, where, path, kind):
        if not os.path.exists(self.resolve(path)):
            self.problems.append(f"{where}: {kind} {path} does not exist (relative to {self.base})")

    def service(self, name, service):
        where = f"services.{name}"
        for i, volume in enumerate(service.get("volumes") or []):
            at = f"{where}.volumes[{i}]"
            if isinstance(volume, str):
                source = short_volume_source(volume)
                if source is not None and is_path(source):
                    self.checked["bind-mount sources"] += 1
                    self.must_exist(at, source, "bind-mount source")
            elif isinstance(volume, dict) and volume.get("type") == "bind":
                self.checked["bind-mount sources"] += 1
                if not volume.get("source"):
                    self.problems.append(f"{at}: a bind mount needs a source")
                else:
                    self.must_exist(at, volume["source"], "bind-mount source")
        build = service.get("build")
        if build is not None:
            if isinstance(build, str):
                build = {"context": build}
            context = build.get("context", ".")
            if isinstance(context, str) and not remote_context(context):
                self.checked["build contexts"] += 1
                self.must_exist(f"{where}.build", context, "build context")
                if "dockerfile_inline" not in build:
                    dockerfile = build.get("dockerfile", "Dockerfile")
                    self.must_exist(
                        f"{where}.build.dockerfile",
                        os.path.join(context, dockerfile),
                        "Dockerfile",
                    )
        env_files = service.get("env_file") or []
        if isinstance(env_files, (str, dict)):
            env_files = [env_files]
        for i, entry in enumerate(env_files):
            path, required = (entry, True) if isinstance(entry, str) else (
                entry.get("path"), entry.get("required", True))
            if path and required is not False:
                self.checked["other files"] += 1
                self.must_exist(f"{where}.env_file[{i}]", path, "env file")

    def top_level_files(self, document):
        for section in ("configs", "secrets"):
            for name, item in (document.get(section) or {}).items():
                if isinstance(item, dict) and item.get("file"):
                    self.checked["other files"] += 1
                    self.must_exist(f"{section}.{name}.file", item["file"], "file")


def validate(path, schema):
    """Every problem of the Compose file at `path`, and a summary."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        return [f"cannot read {path}: {e.strerror}"], ""
    except yaml.YAMLError as e:
        return [f"not valid YAML: {e}"], ""
    if not isinstance(raw, dict):
        return ["the file must hold a mapping (services: …)"], ""
    problems = []
    document = interpolate(raw, problems, "(top level)")
    problems += schema_problems(document, schema)
    checker = Checker(os.path.dirname(os.path.abspath(path)))
    services = document.get("services")
    if isinstance(services, dict):
        for name, service in services.items():
            if isinstance(service, dict):
                checker.service(name, service)
    checker.top_level_files(document)
    problems += checker.problems
    count = len(services) if isinstance(services, dict) else 0
    checked = ", ".join(f"{kind} {n}" for kind, n in checker.checked.items())
    return problems, f"{count} services; present: {checked}"


def main():
    parser = argparse.ArgumentParser(
        description="Validate Compose files against the Compose Specification and check that mounted paths exist."
    )
    parser.add_argument("files", nargs="*", default=[DEFAULT_FILE], help="Compose files (default: docker-compose.yml)")
    parser.add_argument("--schema", default=DEFAULT_SCHEMA, help="the Compose Specification JSON schema")
    args = parser.parse_args()
    try:
        with open(args.schema, encoding="utf-8") as f:
            schema = json.load(f)
    except (OSError, ValueError) as e:
        print(f"error: cannot load the schema {args.schema}: {e}", file=sys.stderr)
        return 2
    failed = False
    for path in args.files:
        shown = path if path != DEFAULT_FILE else os.path.relpath(path)
        problems, summary = validate(path, schema)
        for problem in problems:
            print(f"{shown}: {problem}")
        if problems:
            failed = True
        else:
            print(f"OK {shown}: valid against {os.path.basename(args.schema)}; {summary}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
