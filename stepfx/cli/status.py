"""Exit statuses of the command line: 0 done, 1 an invalid config
(``check``), 2 usage errors (bad arguments, unreadable or non-JSON files;
argparse's own status for bad arguments is 2 as well)."""

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
