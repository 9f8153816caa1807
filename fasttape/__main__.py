"""python -m fasttape {bench,run} ..."""

import sys

USAGE = """usage: python -m fasttape COMMAND [ARGS]

commands:
  bench [options]          fasttape against tf.GradientTape, side by side
  run SCRIPT [ARGS...]     run SCRIPT with fasttape patched in for TF's classes
"""


def run_script(argv):
    if not argv:
        print("usage: python -m fasttape run SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    import runpy
    import fasttape
    fasttape.patch()
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        fasttape.unpatch()
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from fasttape import bench
        return bench.main(rest)
    if command == "run":
        return run_script(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
