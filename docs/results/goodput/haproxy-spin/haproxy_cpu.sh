#!/usr/bin/env bash
# HAProxy's CPU (% of one core: clock ticks per second at 100 Hz) every 2 s for 2 min, with the
# established connections on the HTTP port and the CLOSE-WAIT sockets. Usage: haproxy_cpu.sh PID
HP=$1
prev=$(awk '{print $14+$15}' /proc/$HP/stat)
for i in $(seq 1 60); do sleep 2; cur=$(awk '{print $14+$15}' /proc/$HP/stat 2>/dev/null) || break; echo "$(date +%T) haproxy $(( (cur-prev)/2 ))% conns=$(ss -tn state established '( sport = :8000 )' | tail -n +2 | wc -l) cw=$(ss -tn state close-wait | tail -n +2 | wc -l)"; prev=$cur; done
