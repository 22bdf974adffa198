#!/bin/sh
# make faults / make load: run tshare-stress on host memory, then on GPU
# memory (skipped with the reason where no device is usable). Fails when any
# run fails. Usage: run.sh faults|load BUILD_DIR COUNT
what=$1 build=$2 count=$3
stress=$build/tests/stress/tshare-stress
export TSHARE_LAUNCH="$build/launcher/tshare-launch"
failed=0
run() {
  echo "== tshare-stress $*"
  "$stress" "$@"
  rc=$?
  if [ $rc -eq 77 ]; then echo "   (skipped)"; elif [ $rc -ne 0 ]; then echo "   FAILED (exit $rc)"; failed=1; fi
}
for mem in host cuda; do
  if [ "$what" = faults ]; then
    run kill-consumer $mem --trials "$count" --shares 10000
    run kill-producer $mem --trials 20
    run sigstop $mem --stop-ms 2000
    run sigint-launcher $mem --trials 10
  else
    run load $mem --consumers 4 --shares "$count"
  fi
done
exit $failed
