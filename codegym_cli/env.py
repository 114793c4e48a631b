"""`codegym env ...`: static inspection of environment sources (never runs them)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from codegym.contract import analyze_source, scan_source, tools_schema, tools_text


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"codegym: cannot read {path}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def cmd_describe(args: argparse.Namespace) -> int:
    spec = analyze_source(_read(args.file))
    if spec.violations:
        for v in spec.violations:
            print(f"{args.file}: {v}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps(tools_schema(spec), indent=2, ensure_ascii=False))
    else:
        sys.stdout.write(tools_text(spec))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    source = _read(args.file)
    spec = analyze_source(source)
    findings = scan_source(source)
    if args.format == "json":
        report = {
            "file": args.file,
            "ok": spec.ok,
            "env_class": spec.class_name,
            "sha256": spec.sha256,
            "tools": [t.name for t in spec.tools],
            "violations": [{"code": v.code, "message": v.message, "line": v.line} for v in spec.violations],
            "warnings": [{"code": v.code, "message": v.message, "line": v.line} for v in spec.warnings],
            "safety": [{"kind": f.kind, "detail": f.detail, "line": f.line} for f in findings],
        }
        print(json.dumps(report, indent=2))
        return 0 if spec.ok else 1
    status = "OK" if spec.ok else "FAIL"
    print(f"{args.file}: contract {status}")
    if spec.class_name:
        print(f"  env class: {spec.class_name}")
    if spec.tools:
        print(f"  tools ({len(spec.tools)}): {', '.join(t.name for t in spec.tools)}")
    for v in spec.violations:
        print(f"  violation: {v}")
    for w in spec.warnings:
        print(f"  warning: {w}")
    if findings:
        print(f"  safety findings ({len(findings)}):")
        for f in findings:
            print(f"    {f}")
    else:
        print("  safety findings: none")
    return 0 if spec.ok else 1
