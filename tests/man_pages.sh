#!/bin/sh
# A man page for each installed program: it renders without a warning, and
# it names every option the program's --help names.
# man_pages.sh PROGRAM PAGE
set -eu
program=$1
page=$2
command -v groff >/dev/null 2>&1 || { echo "SKIP: groff is not installed"; exit 77; }
warnings=$(groff -man -Tutf8 -ww -z "$page" 2>&1 || true)
[ -z "$warnings" ] || { echo "FAILED: $page renders with warnings:"; echo "$warnings"; exit 1; }
rendered=$(groff -man -Tutf8 "$page" 2>/dev/null | sed 's/.\x08//g')
status=0
for option in $("$program" --help 2>&1 | grep -o -- '--[a-z][a-z-]*' | sort -u); do
  case "$rendered" in
  *"$option"*) ;;
  *) echo "FAILED: $page does not mention $option"; status=1 ;;
  esac
done
[ $status -ne 0 ] || echo "$page: renders cleanly, names every option of $(basename "$program") --help"
exit $status
