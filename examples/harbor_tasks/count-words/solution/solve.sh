#!/bin/sh
wc -w < /app/text.txt | tr -d " " > /app/count.txt
