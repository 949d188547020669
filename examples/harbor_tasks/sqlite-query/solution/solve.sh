#!/bin/sh
python3 -c "import sqlite3; print(sqlite3.connect('/app/shop.db').execute(\"select sum(qty) from orders where item='apple'\").fetchone()[0])" > /app/apples.txt
