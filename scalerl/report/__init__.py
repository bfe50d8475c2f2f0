"""`scalerl report`: a benchmark report (`benchmark_report.json`) rendered as a PDF or a self-contained HTML
file: headline findings, a recommended configuration with its reasoning, figures, tables, the doctor tree.

Public pieces: `build_document` (what the report says), `write_pdf`, `write_html`."""
