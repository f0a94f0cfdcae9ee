#!/usr/bin/env bash
# As haproxy_cpu.sh for 90 s; whenever HAProxy is above 50 %, the TCP sockets that are neither
# established nor listening, and `show activity` from its admin socket (needs socat).
# Usage: haproxy_cpu_sockets.sh PID ADMIN_SOCKET
HP=$1; A=$2
prev=$(awk '{print $14+$15}' /proc/$HP/stat)
for i in $(seq 1 45); do sleep 2; cur=$(awk '{print $14+$15}' /proc/$HP/stat 2>/dev/null) || break; c=$(( (cur-prev)/2 )); prev=$cur
  echo "$(date +%T) cpu=$c"
  if [ $c -gt 50 ]; then ss -tanp | grep -v ESTAB | grep -v LISTEN | grep -v TIME-WAIT | head -8;
     printf 'show activity\n' | socat - UNIX-CONNECT:$A 2>/dev/null > show-activity.txt
  fi
done
