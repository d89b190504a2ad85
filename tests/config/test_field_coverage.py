"""Every config field is read by the code it configures: a schema field that nothing reads is a defect
(its help text promises something no code does). Needs: CPU, 1 process (reads source files only)."""
import dataclasses
import re
from pathlib import Path

from megaflow.config.schema import MegaflowConfig

PKG = Path(__file__).resolve().parents[2] / "megaflow"


def test_every_schema_field_is_read_somewhere():
    code = "\n".join(p.read_text() for p in PKG.rglob("*.py") if p.name != "schema.py")
    unread = []
    for section in dataclasses.fields(MegaflowConfig):
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else
                                    getattr(MegaflowConfig(), section.name).__class__):
            if not re.search(rf"\.{f.name}\b", code):
                unread.append(f"{section.name}.{f.name}")
    assert not unread, f"config fields read by nothing: {unread}"
