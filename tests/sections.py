"""Several independent checks in ONE launch (launching is the slow part), each failing its own
test: ``run_sections`` records a section's exception under ``(name, "error")`` instead of
ending the launch; ``assert_no_error`` turns it back into that test's failure."""


def run_sections(sections: dict, out: dict, *args) -> dict:
    for name, section in sections.items():
        try:
            section(out, *args)
        except Exception as exc:
            out[name, "error"] = f"{type(exc).__name__}: {exc}"
    return out


def assert_no_error(results, section):
    errors = [r[section, "error"] for r in results if (section, "error") in r]
    assert not errors, errors[0]
