#!/bin/bash
# log the RSS (MiB) of the eval process of this grid every 20 s
while true; do
  for p in $(pgrep -f "kvcompress.cli eval .*issue18-grid" ); do
    echo "$(date -u +%H:%M:%S) $p $(( $(awk '/VmRSS/{print $2}' /proc/$p/status 2>/dev/null || echo 0) / 1024 )) $(tr '\0' ' ' < /proc/$p/cmdline | grep -o 'out [^ ]*')"
  done
  sleep 20
done
