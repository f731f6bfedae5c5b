"""The job layer: everything between a command line and the evaluations it asks for.

    argv      the command line: the only reader of sys.argv; split into Hydra flags, overrides and a
              multiplier set; expansion of multiplier sets (globs, lists, table files) and of sweeps
              (the cartesian product Hydra's basic sweeper would launch)
    commands  the command table's words: each command's one-line help, which are Hydra commands, which
              run on a GPU; the usage and help printers
    plan      a job as data: Plan (what one evaluation will record), Job (its overrides, config, plan and
              run dir), multiplier name/file -> config node, run-directory naming
    hydra     composing many jobs at once and running a command through hydra.main (flags, launchers)
    run       running a list of planned jobs in this process with shared set-up (runner.session)

Commands (train, compare, finetune, sweep, sensitivity, search, bench) are callers of this layer; it imports
none of the command modules except compare, whose run() is the job it runs. See docs/jobs.md."""
