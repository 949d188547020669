#!/bin/sh
echo hello > /app/answer.txt
