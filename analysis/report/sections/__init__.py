"""The report's sections, one module each: `SECTION = Section(...)` (analysis/report/section.py), found by
analysis.report.discover() and placed by its `order`."""
