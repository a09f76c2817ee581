"""The `tandem` command line: the top floor, argument parsing and dispatch only.

It sits above both the product (`cluster/`, `actors/`, `kv_transfer/`) and the measuring tools
(`experiments/`), so neither imports it, and it loads a command's module only when that command runs:
`tandem serve` never imports a benchmark, and a missing optional package stops only the tool that
needs it.
"""
