#!/bin/sh
sed -i 's/sys.argv\[2\]/sys.argv[1]/' /app/greet.py
