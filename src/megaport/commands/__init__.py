"""One module per subcommand: plain functions taking parsed values and returning an exit code."""
